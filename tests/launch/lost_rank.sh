#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# A lost rank costs no data (the distributed example, checkpoints every 3
# steps, written atomically by amp::save_checkpoint):
#  1. the other ranks end with an error naming the lost rank within the
#     timeout - never a hang (one command's ranks, one SIGKILLed);
#  2. torchrun --max-restarts=1 restarts the job after a rank is SIGKILLed
#     at a random step (4 seeds, O2 and O6 sharded), it resumes from the last
#     complete checkpoint, and its weights end bit-identical to an
#     uninterrupted run's;
#  3. a checkpoint written at world 4 loads at world 2 (resharded) bit for
#     bit, and training goes on there.
#   lost_rank.sh <distributed_fashion_mnist> <torchrun> <scratch dir>
set -uo pipefail
example=$1 torchrun=$2 scratch=$3
rm -rf "$scratch" && mkdir -p "$scratch"
common=(--train_limit=1024 --test_limit=128 --batch_size=64 --timeout_s=20)
failures=0
fail() { echo "FAILED: $*"; failures=$((failures + 1)); }
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# 1. No launcher to restart: the survivors name rank 1 and end.
start=$SECONDS
timeout 120 "$example" --world_size=3 --batch_size=48 --opt_level=O2 --shard "${common[@]:0:2}" --timeout_s=10 \
  --steps=8 --kill_rank_at_step=1:3 > "$scratch/survivors.log" 2>&1
rc=$?
took=$((SECONDS - start))
# Rank 2, which rank 0 started, may end after rank 0: within its own timeout.
rank2_named() {
  local _
  for _ in $(seq 60); do
    grep -q "rank 2: lost rank 1: no word from it" "$scratch/survivors.log" && return 0
    sleep 0.5
  done
  return 1
}
if ((rc == 0 || rc == 124)); then
  fail "survivors: exit $rc after $took s (expected an error before the 120 s limit)"
elif ! grep -q "rank 0: lost rank 1: no word from it" "$scratch/survivors.log"; then
  fail "survivors: rank 0 did not name rank 1 (log: $scratch/survivors.log)"
elif ! rank2_named; then
  fail "survivors: rank 2 did not name rank 1 within 30 s (log: $scratch/survivors.log)"
else
  echo "rank 1 killed at step 3: ranks 0 and 2 named it and ended in $took s (exit $rc)"
fi

# 2. Killed at a random step, restarted by torchrun, resumed: bit-identical.
for level in "O2 --shard" "O6 --shard"; do
  read -r -a flags <<< "$level"
  tag=${flags[0]}
  mkdir -p "$scratch/$tag-reference"
  timeout 120 "$example" --world_size=4 --opt_level="$tag" "${flags[@]:1}" "${common[@]}" --steps=10 \
    --save_weights="$scratch/$tag-reference/weights.pt" > "$scratch/$tag-reference.log" 2>&1 || fail "$tag reference run"
done
for seed in 1 2 3 4; do
  read -r rank step <<< "$(python3 -c "import random; r = random.Random($seed); print(r.randrange(4), r.randrange(3, 10))")"
  level=$( ((seed <= 2)) && echo O2 || echo O6)
  dir=$scratch/$level-seed$seed
  mkdir -p "$dir/run"
  timeout 240 "$torchrun" --nnodes=1 --nproc_per_node=4 --max-restarts=1 --master_addr=127.0.0.1 \
    --master_port="$(free_port)" --no-python "$example" --opt_level="$level" --shard "${common[@]}" --steps=10 \
    --checkpoint_dir="$dir/checkpoints" --checkpoint_every=3 --kill_rank_at_step="$rank:$step" \
    --save_weights="$dir/run/weights.pt" > "$dir/torchrun.log" 2>&1
  rc=$?
  resumed=$(grep -o "resumed from [^ ]*" "$dir/torchrun.log" | sed 's|.*/||')
  expected=$( ((step >= 3)) && echo "step-$((step / 3 * 3)).pt" || echo "")
  if ((rc != 0)); then
    fail "$level seed $seed: torchrun exited $rc (log: $dir/torchrun.log)"
  elif ! grep -q "exitcode: -9) local_rank: $rank" "$dir/torchrun.log"; then
    fail "$level seed $seed: torchrun did not report local rank $rank killed"
  elif [ "$resumed" != "$expected" ]; then
    fail "$level seed $seed: resumed from '${resumed}', expected '${expected}'"
  elif ! cmp -s "$dir/run/weights.pt" "$scratch/$level-reference/weights.pt"; then
    fail "$level seed $seed: the weights differ from the uninterrupted run's"
  else
    echo "$level sharded, seed $seed: rank $rank killed at step $step, restarted, resumed from ${resumed:-the start}: weights bit-identical"
  fi
done

# 3. Written at world 4, loaded at world 2: the same weights, then more steps.
dir=$scratch/reshard
mkdir -p "$dir/four" "$dir/two"
timeout 120 "$example" --world_size=4 --opt_level=O2 --shard "${common[@]}" --steps=6 --checkpoint_dir="$dir/checkpoints" \
  --checkpoint_every=6 --save_weights="$dir/four/weights.pt" > "$dir/four.log" 2>&1 || fail "reshard: the world of 4"
timeout 120 "$example" --world_size=2 --opt_level=O2 --shard "${common[@]}" --steps=6 --checkpoint_dir="$dir/checkpoints" \
  --checkpoint_every=100 --save_weights="$dir/two/weights.pt" > "$dir/two.log" 2>&1 || fail "reshard: loading at world 2"
timeout 120 "$example" --world_size=2 --opt_level=O2 --shard "${common[@]}" --steps=10 --checkpoint_dir="$dir/checkpoints" \
  --checkpoint_every=100 > "$dir/two_on.log" 2>&1 || fail "reshard: training on at world 2"
if ! grep -q "resumed from .*step-6.pt" "$dir/two.log" || ! cmp -s "$dir/four/weights.pt" "$dir/two/weights.pt"; then
  fail "reshard: world 2 did not load world 4's checkpoint bit for bit"
elif ! grep -q "final loss .* (step 10" "$dir/two_on.log"; then
  fail "reshard: world 2 did not train on to step 10"
else
  echo "world 4's checkpoint at step 6 loaded at world 2 bit for bit; $(grep -o 'final loss [0-9.]* (step 10' "$dir/two_on.log") there"
fi
((failures == 0)) && echo "a lost rank costs no data"
exit $((failures > 0))
