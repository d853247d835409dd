#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Sets up and builds amp (tools/setup.sh), then trains the Fashion-MNIST CNN
# example on Debian's dataset-fashion-mnist. Arguments go to the example,
# e.g. tools/run_example.sh --opt_level=O2 --epochs=3 (see --help).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
AMP_BUILD_TARGETS=fashion_mnist "$root/tools/setup.sh"
exec "${AMP_BUILD_DIR:-$root/build}/examples/fashion_mnist" "$@"
