#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Runs the test suite against amp built with sanitizers:
#
#   tools/run_sanitized_tests.sh [address] [thread]   (default: both)
#
# The suite's objects are compiled once (tools/run_tests.sh's build); here
# they link against the library built again with AddressSanitizer +
# UndefinedBehaviorSanitizer (amp_tests_asan: every test) or ThreadSanitizer
# (amp_tests_tsan: the *ThreadsTest suites, whose tests run amp on several
# threads; the rest of the suite is single-threaded). LibTorch and the test
# code stay uninstrumented, so what is checked is amp's own code. Both
# libraries build in one call (their batches share the cores); each suite
# runs in one shard per core.
# LeakSanitizer is off because LibTorch keeps process-lifetime allocations
# (op registries, thread pools) by design; tests/tsan_suppressions.txt names
# LibTorch's parallel kernels, whose synchronisation TSan cannot see.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${AMP_BUILD_DIR:-$root/build}
modes=("$@")
((${#modes[@]})) || modes=(address thread)
targets=()
for mode in "${modes[@]}"; do
  case "$mode" in
    address) targets+=(amp_tests_asan) ;;
    thread) targets+=(amp_tests_tsan) ;;
    *) echo "usage: tools/run_sanitized_tests.sh [address] [thread]" >&2; exit 2 ;;
  esac
done
grep -q "AMP_SANITIZERS:BOOL=ON" "$build/CMakeCache.txt" 2>/dev/null && sanitizers=() || sanitizers=(-DAMP_SANITIZERS=ON)
AMP_BUILD_DIR="$build" AMP_BUILD_TARGETS="${targets[*]}" "$root/tools/setup.sh" "${sanitizers[@]}"

# run_sharded BINARY FILTER: the tests in one process per core, each with
# one LibTorch thread; fails if any shard fails, printing its output.
run_sharded() {
  local binary=$1 filter=$2 shards i rc=0 start=$SECONDS
  shards=$(nproc)
  local logs=() pids=()
  for ((i = 0; i < shards; i++)); do
    logs+=("$(mktemp)")
    OMP_NUM_THREADS=1 GTEST_TOTAL_SHARDS=$shards GTEST_SHARD_INDEX=$i \
      "$binary" --gtest_brief=1 --gtest_filter="$filter" > "${logs[i]}" 2>&1 &
    pids+=($!)
  done
  for ((i = 0; i < shards; i++)); do
    if ! wait "${pids[i]}"; then
      rc=1
      echo "shard $i of $shards failed:"
      cat "${logs[i]}"
    fi
  done
  grep -h "^\[  PASSED  \]\|^\[  SKIPPED \] [0-9]" "${logs[@]}" | sed "s/^/  /"
  rm -f "${logs[@]}"
  echo "  ($((SECONDS - start)) s in $shards shards)"
  return $rc
}

rc=0
for mode in "${modes[@]}"; do
  case "$mode" in
    # Tests that train in dist_helper processes run amp unsanitized there,
    # and the Python peer tests spend their time in Python: the sanitized
    # suite leaves them out.
    address)
      echo "address sanitizer: amp_tests_asan without the tests whose amp runs in other processes"
      ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
        run_sharded "$build/tests/amp_tests_asan" \
        '*-RanksAsProcesses.*:*BuiltInDataParallel.*:*HandWrittenAllReduce.*:*ShardedDataParallel.*:*PeerTest.*' || rc=1 ;;
    thread)
      echo "thread sanitizer: amp_tests_tsan --gtest_filter=*ThreadsTest.*"
      TSAN_OPTIONS="halt_on_error=1:suppressions=$root/tests/tsan_suppressions.txt" \
        run_sharded "$build/tests/amp_tests_tsan" '*ThreadsTest.*' || rc=1 ;;
  esac
done
exit $rc
