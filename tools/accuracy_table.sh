#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Trains the Fashion-MNIST example at O0-O6 for each seed (same epochs, data
# and seed at every level) and prints a markdown table of test accuracy,
# time per epoch and skipped steps, on all 60,000 training images unless a
# flag says otherwise. Runs one training at a time so the
# times are comparable.
#
#   tools/accuracy_table.sh [seeds (default "0 1")] [extra fashion_mnist flags...]
#   tools/accuracy_table.sh "0 1" --epochs=3 --dtype=bf16
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
example=${AMP_BUILD_DIR:-$root/build}/examples/fashion_mnist
seeds=${1:-0 1}; shift || true
echo "| seed | level | test accuracy % | time per epoch s | skipped steps |"
echo "|---:|---|---:|---:|---:|"
for seed in $seeds; do
  for level in O0 O1 O2 O3 O4 O5 O6 O5+fp8; do
    summary=$("$example" --opt_level=$level --seed=$seed --verbosity=0 --train_limit=0 "$@" | tail -n 1)
    # summary: opt_level O1  test accuracy 90.79%  time/epoch 14.4 s  skipped steps 0  peak RSS ...
    read -r accuracy epoch_s skipped < <(sed -E 's/.*accuracy ([0-9.]+)%.*epoch ([0-9.]+) s.*steps ([0-9]+).*/\1 \2 \3/' <<<"$summary")
    echo "| $seed | $level | $accuracy | $epoch_s | $skipped |"
  done
done
