#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Runs a benchmark program of this folder under valgrind's callgrind, its
# dumps (one per labelled measurement) into a folder, for the table scripts
# (dispatch_instructions.sh, step_instructions.sh).
# Usage: tools/bench/run_callgrind.sh <build dir> <program> <out dir>
set -euo pipefail
build=$1 program=$2 out=$3
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
[[ -x "$build/tools/$program" ]] || { echo "no $build/tools/$program: build it first (cmake --build $build --target benchmarks)" >&2; exit 1; }
valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$out/cg.%p" \
  "$build/tools/$program" 2>"$out/log" || { cat "$out/log" >&2; exit 1; }
