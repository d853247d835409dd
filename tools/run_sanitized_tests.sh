#!/usr/bin/env bash
# Runs the test suite against amp built with sanitizers:
#
#   tools/run_sanitized_tests.sh [address|thread]   (default: address)
#
# The suite's objects are compiled once (tools/run_tests.sh's build); here
# they link against the library built again with AddressSanitizer +
# UndefinedBehaviorSanitizer (amp_tests_asan: every test) or ThreadSanitizer
# (amp_tests_tsan: the *ThreadsTest suites, whose tests run amp on several
# threads; the rest of the suite is single-threaded). LibTorch and the test
# code stay uninstrumented, so what is checked is amp's own code.
# LeakSanitizer is off because LibTorch keeps process-lifetime allocations
# (op registries, thread pools) by design; tests/tsan_suppressions.txt names
# LibTorch's parallel kernels, whose synchronisation TSan cannot see.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${AMP_BUILD_DIR:-$root/build}
mode=${1:-address}
case "$mode" in
  # Tests that train in dist_helper processes run amp unsanitized there,
  # and the Python peer tests spend their time in Python: the sanitized
  # suite leaves them out.
  address) target=amp_tests_asan
    filter='*-RanksAsProcesses.*:*BuiltInDataParallel.*:*HandWrittenAllReduce.*:*ShardedDataParallel.*:*PeerTest.*'
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
    export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ;;
  thread) target=amp_tests_tsan; filter='*ThreadsTest.*'
    export TSAN_OPTIONS="halt_on_error=1:suppressions=$root/tests/tsan_suppressions.txt" ;;
  *) echo "usage: tools/run_sanitized_tests.sh [address|thread]" >&2; exit 2 ;;
esac
grep -q "AMP_SANITIZERS:BOOL=ON" "$build/CMakeCache.txt" 2>/dev/null && sanitizers=() || sanitizers=(-DAMP_SANITIZERS=ON)
AMP_BUILD_DIR="$build" AMP_BUILD_TARGETS="$target" "$root/tools/setup.sh" "${sanitizers[@]}"
echo "$mode sanitizer: running $target --gtest_filter=$filter"
"$build/tests/$target" --gtest_brief=1 --gtest_filter="$filter"
