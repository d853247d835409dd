#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Installs amp from the build tree into a scratch prefix, then configures,
# builds and runs tests/consumer against it.
set -euo pipefail
build_dir=$1 prefix_path=${2//:/;} generator=$3  # $2: LibTorch's (and others') prefixes, ':'-separated
here=$(cd "$(dirname "$0")" && pwd)
scratch=$build_dir/consumer
rm -rf "$scratch" && mkdir -p "$scratch"
cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
# No build type: unoptimized, as what is tested is the package, not speed
# (the program compiles in half of Release's time).
cmake -S "$here" -B "$scratch/build" -G "$generator" -DCMAKE_BUILD_TYPE= \
  -DCMAKE_PREFIX_PATH="$scratch/prefix;$prefix_path" -DTORCH_CUDA_ARCH_LIST=9.0 > "$scratch/configure.log" 2>&1 \
  || { cat "$scratch/configure.log"; exit 1; }
cmake --build "$scratch/build"
"$scratch/build/consumer"
