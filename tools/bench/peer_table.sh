#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# amp side by side with Python's torch.amp on this machine, in one run: the
# Fashion-MNIST CNN and the character transformer at amp O0/O1/O2/O5 and O1
# with Options::measured_policy, and the
# same models and loops in Python (tools/bench/peer_examples.py) in fp32,
# with autocast bf16, and with autocast bf16 + GradScaler. Prints a Markdown
# table (time per step, peak RSS, accuracy or final loss) and the CPU.
#
#   tools/bench/peer_table.sh [TRAIN_LIMIT] [TRANSFORMER_STEPS]   (defaults 20000, 200)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
train_limit=${1:-20000}
steps=${2:-200}
AMP_BUILD_TARGETS="fashion_mnist transformer_lm" "$root/tools/setup.sh" >/dev/null
build=${AMP_BUILD_DIR:-$root/build}
python="$root/.venv/bin/python -W ignore $root/tools/bench/peer_examples.py"

field() {  # field NAME LINE: the value after NAME in an example's summary line
  sed -E "s|.*$1 ([0-9.]+%?).*|\1|" <<<"$2"
}
row() {  # row MODEL WHAT LINE
  local metric
  if [ "$1" = fashion_mnist ]; then metric="$(field 'test accuracy' "$3")"; else metric="$(field 'final loss' "$3")"; fi
  printf '| %s | %s | %s | %s | %s |\n' "$1" "$2" "$(field 'ms/step' "$3")" "$(field 'peak RSS' "$3")" "$metric"
}

echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), $(nproc) cores;" \
     "flags: $(grep -o -w -E 'avx512_bf16|amx_bf16|avx512_fp16|avx512f|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "Date: $(date -u +%Y-%m-%d). One run each, one after another; ms/step covers training only."
echo
echo "| model | run | ms/step | peak RSS (MiB) | test accuracy / final loss |"
echo "|---|---|---|---|---|"
# table MODEL "AMP EXAMPLE COMMAND" "PEER ARGUMENTS" SUMMARY_PATTERN
table() {
  for level in O0 O1 O2 O5; do
    row "$1" "amp $level" "$($2 --opt_level=$level --verbosity=0 | grep "$4")"
  done
  row "$1" "amp O1, measured policy" "$($2 --opt_level=O1 --measured_policy --verbosity=0 | grep "$4")"
  for mode in fp32 autocast autocast_scaler; do
    row "$1" "torch.amp $mode" "$($python "$1" $mode $3)"
  done
}
table fashion_mnist "$build/examples/fashion_mnist --train_limit=$train_limit" "--train_limit=$train_limit" "test accuracy"
table transformer "$build/examples/transformer_lm --steps=$steps --sample_chars=1" "--steps=$steps" "final loss"
