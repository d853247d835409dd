#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Trains the Fashion-MNIST example at O0, O1, O2 and O3 (same seed and data),
# writes each run's per-step CSV and summary, and plots loss and loss scale
# of all four on one chart (gnuplot PNG).
#
#   tools/plot_training.sh [out_dir] [extra fashion_mnist flags...]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:-$root/out/training}; shift || true
example=${AMP_BUILD_DIR:-$root/build}/examples/fashion_mnist
mkdir -p "$out"
for level in O0 O1 O2 O3; do
  "$example" --opt_level=$level --csv="$out/$level.csv" --verbosity=0 --train_limit=0 "$@" | tail -n 1 | tee "$out/$level.txt"
done
gnuplot <<GNUPLOT
set terminal png size 1000,700
set output '$out/training.png'
set datafile separator ','
set multiplot layout 2,1 title 'Fashion-MNIST CNN with amp: loss and loss scale per step'
set ylabel 'loss (smoothed)'
set key top right
plot for [l in "O0 O1 O2 O3"] '$out/'.l.'.csv' using 1:2 skip 1 smooth bezier with lines lw 2 title l
set ylabel 'loss scale'
set logscale y 2
set yrange [0.5:262144]
set xlabel 'step'
plot for [l in "O0 O1 O2 O3"] '$out/'.l.'.csv' using 1:3 skip 1 with lines title l
unset multiplot
GNUPLOT
echo "wrote $out/training.png"
