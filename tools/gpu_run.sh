#!/usr/bin/env bash
# On the GPU machine: builds amp against the machine's LibTorch (its python3
# holds torch 2.11.0+cu130), runs the whole test suite - the CUDA tests
# included - and the GPU benchmark, writing everything to <out_dir>.
#
#   tools/gpu_run.sh "$OUT"
#
# That machine has CMake, Ninja and nvcc but no GoogleTest or Abseil: run
# tools/fetch_gpu_deps.sh here first and carry third_party/ along. The
# examples and CPU tools (Abseil) are not built there. Then runs
# tools/bench/gpu_peer.py, Python's torch.amp on the same models.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${1:?usage: tools/gpu_run.sh <out_dir>}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" || true
torch_prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)')
cmake -S "$root" -B "$root/build-gpu" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$torch_prefix" -DTORCH_CUDA_ARCH_LIST="9.0" \
  -DAMP_GPU=ON -DAMP_BUILD_EXAMPLES=OFF -DAMP_GTEST_SOURCE_DIR="$root/third_party/googletest" > "$out/configure.log" 2>&1
cmake --build "$root/build-gpu" -j"$(nproc)" > "$out/build.log" 2>&1
set +e
"$root/build-gpu/tests/amp_tests" > "$out/tests.txt" 2>&1
echo "amp_tests exit code $?" >> "$out/tests.txt"
"$root/build-gpu/tools/gpu_benchmarks" 10 50 > "$out/gpu_benchmarks.md" 2> "$out/gpu_benchmarks.err"
echo "gpu_benchmarks exit code $?" >> "$out/gpu_benchmarks.err"
# What a Python user runs instead, same models and sizes, same GPU.
python3 "$root/tools/bench/gpu_peer.py" 10 50 > "$out/gpu_peer.md" 2> "$out/gpu_peer.err"
echo "gpu_peer exit code $?" >> "$out/gpu_peer.err"
tail -n 3 "$out/tests.txt"
cat "$out/gpu_benchmarks.md" "$out/gpu_peer.md"
