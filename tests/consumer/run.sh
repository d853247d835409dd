#!/usr/bin/env bash
# Installs amp from the build tree into a scratch prefix, then configures,
# builds and runs tests/consumer against it.
set -euo pipefail
build_dir=$1 torch_prefix=$2 generator=$3
here=$(cd "$(dirname "$0")" && pwd)
scratch=$build_dir/consumer
rm -rf "$scratch" && mkdir -p "$scratch"
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
cmake -S "$here" -B "$scratch/build" -G "$generator" -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_PREFIX_PATH="$scratch/prefix;$torch_prefix" -DTORCH_CUDA_ARCH_LIST=9.0 >/dev/null 2>&1
cmake --build "$scratch/build"
"$scratch/build/consumer"
