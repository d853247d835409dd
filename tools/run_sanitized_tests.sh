#!/usr/bin/env bash
# Builds amp and its test suite with sanitizers and runs it:
#
#   tools/run_sanitized_tests.sh [address|thread]   (default: address)
#
# address: AddressSanitizer + UndefinedBehaviorSanitizer (AMP_SANITIZE=ON) in
#   build-asan/. LeakSanitizer is off because LibTorch keeps process-lifetime
#   allocations (op registries, thread pools) by design.
# thread: ThreadSanitizer (AMP_TSAN=ON) in build-tsan/, with
#   tests/tsan_suppressions.txt for LibTorch's own parallel kernels, on the
#   tests that run amp on several threads (concurrent forwards sharing the
#   cast cache, worker threads, autograd and intra-op threads; their names
#   contain Thread or Concurrent): the other tests are single-threaded and
#   run under the other two suites, as do the distributed tests, whose
#   races would all be inside uninstrumented Gloo threads.
# LibTorch itself is not instrumented in either mode.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mode=${1:-address}
case "$mode" in
  address) build="$root/build-asan"; option=-DAMP_SANITIZE=ON; filter='*'; target=amp_tests
    export ASAN_OPTIONS=detect_leaks=0:abort_on_error=1
    export UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ;;
  thread) build="$root/build-tsan"; option=-DAMP_TSAN=ON; filter='*Thread*:*Concurrent*'; target=amp_thread_tests
    export TSAN_OPTIONS="halt_on_error=1:suppressions=$root/tests/tsan_suppressions.txt" ;;
  *) echo "usage: tools/run_sanitized_tests.sh [address|thread]" >&2; exit 2 ;;
esac
AMP_BUILD_DIR="$root/build" "$root/tools/setup.sh" >/dev/null  # packages and LibTorch
torch_prefix=$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$option" \
  -DAMP_BUILD_EXAMPLES=OFF -DAMP_BUILD_TOOLS=OFF -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DTORCH_CUDA_ARCH_LIST=9.0 > "$build.configure.log" 2>&1 || { cat "$build.configure.log"; exit 1; }
cmake --build "$build" -j"$(nproc)" --target "$target"
[ "$filter" = '*' ] || echo "$mode sanitizer: running $target with --gtest_filter=$filter"
"$build/tests/$target" --gtest_brief=1 --gtest_filter="$filter"
