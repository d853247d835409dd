#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# A team's project takes amp in one way (tests/consumer/CMakeLists.txt) on a
# machine with only LibTorch (GoogleTest, zlib, Abseil and Python are hidden
# from CMake where amp builds from source), then builds and runs it.
#   run.sh find_package <amp build dir> <prefix path> <generator>
#     installs amp from its build folder into a scratch prefix and uses that;
#     then builds amp's examples against the same installed amp, as a
#     project of their own (examples/CMakeLists.txt), and runs one.
#   run.sh fetchcontent|subdirectory <amp build dir> <prefix path> <generator> <amp checkout>
#     builds amp from the checkout inside the project (subdirectory: the
#     configure only; its build is FetchContent's, which adds this very
#     add_subdirectory).
set -euo pipefail
way=$1 build_dir=$2 prefix_path=${3//:/;} generator=$4 source_dir=${5:-}  # $3: ':'-separated
here=$(cd "$(dirname "$0")" && pwd)
scratch=$build_dir/consumer-$way
rm -rf "$scratch" && mkdir -p "$scratch"
# configure LOG SOURCE BUILD ARGS...: quiet unless it fails. No build type:
# unoptimized, as what is tested is the build, not speed (half Release's time).
configure() {
  local log=$1
  shift
  cmake -S "$1" -B "$2" -G "$generator" -DCMAKE_BUILD_TYPE= -DTORCH_CUDA_ARCH_LIST=9.0 "${@:3}" > "$log" 2>&1 \
    || { cat "$log"; exit 1; }
}
case $way in
  find_package)
    cmake --install "$build_dir" --prefix "$scratch/prefix" >/dev/null
    configure "$scratch/configure.log" "$here" "$scratch/build" -DAMP_WAY=find_package \
      -DCMAKE_PREFIX_PATH="$scratch/prefix;$prefix_path"
    cmake --build "$scratch/build"
    "$scratch/build/consumer"
    # The examples, against the installed amp: the Fashion-MNIST program, two steps.
    configure "$scratch/examples.log" "$here/../../examples" "$scratch/examples" \
      -DCMAKE_PREFIX_PATH="$scratch/prefix;$prefix_path"
    cmake --build "$scratch/examples" --target fashion_mnist
    "$scratch/examples/fashion_mnist" --opt_level=O2 --train_limit=64 --test_limit=64 --batch_size=32 --verbosity=0
    echo "examples built against the installed amp"
    ;;
  fetchcontent|subdirectory)
    hidden=(-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON -DCMAKE_DISABLE_FIND_PACKAGE_ZLIB=ON
            -DCMAKE_DISABLE_FIND_PACKAGE_absl=ON -DCMAKE_DISABLE_FIND_PACKAGE_Python3=ON)
    configure "$scratch/configure.log" "$here" "$scratch/build" -DAMP_WAY="$way" -DAMP_SOURCE_DIR="$source_dir" \
      -DCMAKE_PREFIX_PATH="$prefix_path" "${hidden[@]}"
    if [ "$way" = subdirectory ]; then
      grep -q "^build consumer:" "$scratch/build/build.ninja" 2>/dev/null || [ -f "$scratch/build/Makefile" ]
      echo "consumer ok: configured with amp by add_subdirectory"
      exit 0
    fi
    cmake --build "$scratch/build"
    "$scratch/build/consumer"
    ;;
  *) echo "usage: run.sh find_package|fetchcontent|subdirectory ..." >&2; exit 2 ;;
esac
