#!/usr/bin/env bash
# Sets up and builds amp (tools/setup.sh), then runs the whole test suite.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$root/tools/setup.sh"
ctest --test-dir "${AMP_BUILD_DIR:-$root/build}" --output-on-failure -j2 "$@"
