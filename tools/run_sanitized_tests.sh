#!/usr/bin/env bash
# Builds amp and its test suite with AddressSanitizer and
# UndefinedBehaviorSanitizer (AMP_SANITIZE=ON) in build-asan/ and runs it.
# LibTorch itself is not instrumented; LeakSanitizer is off because LibTorch
# keeps process-lifetime allocations (op registries, thread pools) by design.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AMP_BUILD_DIR="$root/build" "$root/tools/setup.sh" >/dev/null  # packages and LibTorch
torch_prefix=$("$root/.venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
cmake -S "$root" -B "$root/build-asan" -G Ninja -DCMAKE_BUILD_TYPE=Release -DAMP_SANITIZE=ON \
  -DAMP_BUILD_EXAMPLES=OFF -DAMP_BUILD_TOOLS=OFF -DCMAKE_PREFIX_PATH="$torch_prefix" \
  -DTORCH_CUDA_ARCH_LIST=9.0 > "$root/build-asan.configure.log" 2>&1 \
  || { cat "$root/build-asan.configure.log"; exit 1; }
cmake --build "$root/build-asan" -j"$(nproc)" --target amp_tests
ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
  "$root/build-asan/tests/amp_tests" --gtest_brief=1
