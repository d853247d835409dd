#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# amp refuses a LibTorch of another minor version at configure time - its
# own build and the installed find_package(amp) config alike - with a message
# that says what to do, and AMP_ALLOW_UNSUPPORTED_TORCH turns the refusal into
# a warning. The other LibTorch is a stand-in package that says 2.12.0.
#   torch_version_pin.sh <amp checkout> <amp build dir> <generator>
set -euo pipefail
source_dir=$1 build_dir=$2 generator=$3
scratch=$build_dir/torch-version-pin
rm -rf "$scratch" && mkdir -p "$scratch/other_torch/Torch" "$scratch/project"
cat > "$scratch/other_torch/Torch/TorchConfig.cmake" <<'CMAKE'
set(Torch_FOUND TRUE)
if(NOT TARGET torch)
  add_library(torch INTERFACE IMPORTED)
endif()
set(TORCH_LIBRARIES torch)
CMAKE
cat > "$scratch/other_torch/Torch/TorchConfigVersion.cmake" <<'CMAKE'
set(PACKAGE_VERSION "2.12.0")
set(PACKAGE_VERSION_COMPATIBLE TRUE)
CMAKE
# expect NAME STATUS PATTERN CMD...: CMD exits with STATUS (0 or nonzero) and prints PATTERN.
expect() {
  local name=$1 status=$2 pattern=$3 rc=0
  shift 3
  "$@" > "$scratch/$name.log" 2>&1 || rc=$?
  if { [ "$status" = 0 ] && ((rc != 0)); } || { [ "$status" = nonzero ] && ((rc == 0)); } \
     || ! tr -s ' \n' ' ' < "$scratch/$name.log" | grep -q "$pattern"; then
    echo "FAILED: $name (exit $rc, expected $status and '$pattern'):"
    cat "$scratch/$name.log"
    exit 1
  fi
  echo "ok: $name"
}
library_only=(-DAMP_BUILD_TESTS=OFF -DAMP_BUILD_EXAMPLES=OFF -DAMP_BUILD_TOOLS=OFF)
expect build_refuses nonzero "supports LibTorch 2.11.x only; found LibTorch 2.12.0.*-DAMP_ALLOW_UNSUPPORTED_TORCH=ON" \
  cmake -S "$source_dir" -B "$scratch/refused" -G "$generator" -DCMAKE_PREFIX_PATH="$scratch/other_torch" "${library_only[@]}"
expect build_allows_when_asked 0 "Continuing, as AMP_ALLOW_UNSUPPORTED_TORCH is ON" \
  cmake -S "$source_dir" -B "$scratch/allowed" -G "$generator" -DCMAKE_PREFIX_PATH="$scratch/other_torch" \
        -DAMP_ALLOW_UNSUPPORTED_TORCH=ON "${library_only[@]}"
# The installed package, found by a project whose LibTorch is the other one.
cmake --install "$build_dir" --prefix "$scratch/prefix" > /dev/null
cat > "$scratch/project/CMakeLists.txt" <<'CMAKE'
cmake_minimum_required(VERSION 3.25)
project(uses_amp CXX)
find_package(amp REQUIRED)
CMAKE
expect package_refuses nonzero "supports LibTorch 2.11.x only; found LibTorch 2.12.0" \
  cmake -S "$scratch/project" -B "$scratch/project/build" -G "$generator" \
        -DCMAKE_PREFIX_PATH="$scratch/other_torch;$scratch/prefix"
echo "LibTorch pinned: another minor version is refused, by the build and by the package"
