#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Downloads, here, the Debian packages the GPU machine lacks into the
# git-ignored third_party_debs/ (about 34 MB), for tools/gpu_run.sh to unpack
# there: Abseil (the examples' and tools' flags), GoogleTest's sources, gloo's
# headers (LibTorch's ProcessGroupGloo.hpp), zlib (the examples read .gz
# files) and the Fashion-MNIST data; and wheels for the GPU machine's Python
# 3.12, which has torch and Triton but neither: torchao's (the Python peer's
# float8 rows) and Liger Kernel's with packaging, which it imports (the loss
# table's fused linear cross-entropy). Carry third_party_debs along.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=$root/third_party_debs
packages=(libabsl-dev libabsl20220623 googletest libgloo-dev zlib1g-dev dataset-fashion-mnist)
mkdir -p "$dir"
if ! (cd "$dir" && apt-get download "${packages[@]}" >/dev/null 2>&1); then
  sudo=""; [ "$(id -u)" -ne 0 ] && sudo=sudo
  $sudo apt-get update -qq
  (cd "$dir" && apt-get download "${packages[@]}" >/dev/null)
fi
torchao=0.18.0  # the release built against torch 2.11
python=$root/.venv/bin/python; [ -x "$python" ] || python=python3
liger=0.8.5  # tools/setup.sh installs the same here
for wheel in "torchao==$torchao" "liger-kernel==$liger" packaging; do
  name=${wheel%%=*}
  ls "$dir/${name//-/_}"-*.whl >/dev/null 2>&1 ||
    "$python" -m pip download -q "$wheel" --no-deps --only-binary=:all: --python-version 3.12 \
      --platform manylinux_2_28_x86_64 -d "$dir"
done
echo "fetch_gpu_deps: $(ls "$dir"/*.deb | wc -l) packages and $(ls "$dir"/*.whl | wc -l) wheels in $dir ($(du -sh "$dir" | cut -f1))"
