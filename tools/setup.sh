#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Installs what amp's build needs, then configures and builds it.
#
# Idempotent and quick when everything is present: Debian packages are
# installed only when missing, LibTorch 2.11.0 comes from the PyPI torch wheel
# in the project-local virtual environment .venv/, and the CMake build lives in
# build/ (override with AMP_BUILD_DIR). AMP_BUILD_TARGETS names the targets to
# build (default: all; tools/run_example.sh builds only the example). Extra
# arguments are passed to CMake's configure step, e.g.
# tools/setup.sh -DAMP_SANITIZERS=ON, and so are those in AMP_CMAKE_ARGS
# (space-separated), e.g. AMP_CMAKE_ARGS=-DAMP_CUDA_KERNELS=OFF.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build_dir=${AMP_BUILD_DIR:-$root/build}
torch_version=2.11.0

packages=(cmake g++ ninja-build python3-venv libabsl-dev googletest libgtest-dev doxygen
          libgloo-dev zlib1g-dev dataset-fashion-mnist gnuplot-nox)
missing=()
for package in "${packages[@]}"; do
  dpkg -s "$package" >/dev/null 2>&1 || missing+=("$package")
done
if ((${#missing[@]})); then
  echo "setup: installing ${missing[*]}"
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${missing[@]}" >/dev/null
fi

venv=$root/.venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
if ! "$venv/bin/python" - 2>/dev/null <<PY
import sys, torch
sys.exit(torch.__version__.split("+")[0] != "$torch_version")
PY
then
  echo "setup: installing torch==$torch_version (LibTorch) into .venv"
  "$venv/bin/pip" install -q "torch==$torch_version"
fi
# The loss layer's Python peers (tools/bench/loss_layer_peer.py): Liger
# Kernel's fused linear cross-entropy, and numpy, which Triton's interpreter
# needs to run Liger's kernels on a CPU (numpy 2.4 breaks it).
if ! "$venv/bin/python" -c 'import liger_kernel, numpy, packaging' 2>/dev/null; then
  echo "setup: installing liger-kernel, numpy and packaging into .venv"
  "$venv/bin/pip" install -q --no-deps "liger-kernel==0.8.5" "numpy<2.4" packaging
fi
torch_prefix=$("$venv/bin/python" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)

read -r -a extra <<< "${AMP_CMAKE_ARGS:-}"
if [ ! -f "$build_dir/CMakeCache.txt" ] || (($# + ${#extra[@]})); then
  cmake -S "$root" -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_PREFIX_PATH="$torch_prefix" -DTORCH_CUDA_ARCH_LIST=9.0 "${extra[@]}" "$@" \
    > "$build_dir.configure.log" 2>&1 || { cat "$build_dir.configure.log"; exit 1; }
fi
targets=()
for target in ${AMP_BUILD_TARGETS:-}; do targets+=(--target "$target"); done
echo "setup: building ${AMP_BUILD_TARGETS:-everything} in $build_dir"
cmake --build "$build_dir" -j"$(nproc)" "${targets[@]}"
