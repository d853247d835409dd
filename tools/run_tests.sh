#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Sets up and builds amp (tools/setup.sh), then runs the whole test suite,
# printing each part's time.
#
# ctest runs one test program per core, each with one LibTorch thread
# (OMP_NUM_THREADS=1, unless set): a program per core with a LibTorch thread
# per core spent a third of the suite's CPU time spinning in OpenMP's waits
# (381 s against 248 s on 2 cores).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
start=$SECONDS
"$root/tools/setup.sh"
echo "run_tests: set-up and build took $((SECONDS - start)) s"
start=$SECONDS
OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} ctest --test-dir "${AMP_BUILD_DIR:-$root/build}" --output-on-failure \
  -j"$(nproc)" "$@"
echo "run_tests: the suite (ctest) took $((SECONDS - start)) s"
