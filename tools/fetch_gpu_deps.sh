#!/usr/bin/env bash
# Copies what tools/gpu_run.sh needs but the GPU machine lacks into the
# git-ignored third_party/: GoogleTest's sources (Debian's googletest).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dpkg -s googletest >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq googletest; }
mkdir -p "$root/third_party"
rm -rf "$root/third_party/googletest"
cp -r /usr/src/googletest "$root/third_party/googletest"
echo "third_party/googletest ready (carry it to the GPU machine)"
