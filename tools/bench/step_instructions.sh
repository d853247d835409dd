#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Instructions per training step on the host (callgrind) and ATen ops per
# step (LibTorch's profiler): LibTorch float32, native autocast with the
# loss-scaling loop, amp's levels (tools/bench/step_instructions.cpp).
# Usage: tools/bench/step_instructions.sh [build dir]   (after tools/setup.sh)
set -euo pipefail
build=${1:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bash "$(dirname "${BASH_SOURCE[0]}")/run_callgrind.sh" "$build" step_instructions "$out"
python3 - "$out" <<'PY'
import glob, re, sys
rows = []
for path in glob.glob(sys.argv[1] + "/cg.*"):
    text = open(path).read()
    label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
    total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    part = re.search(r"^part: (\d+)$", text, re.M)
    if label and total:
        name, steps, ops = label.group(1).split("|")
        rows.append((int(part.group(1)) if part else 0, name, int(total.group(1)) / int(steps), int(ops)))
rows.sort()
by_name = {name: (instr, ops) for _, name, instr, ops in rows}
native_instr, native_ops = by_name["native autocast + loss-scaling loop"]
fp32_instr, _ = by_name["LibTorch float32"]
print("| step (3 x 64-wide layers, batch 8, AdamW) | instructions / step | / native | / float32 | ATen ops / step | / native |")
print("|---|---:|---:|---:|---:|---:|")
for _, name, instr, ops in rows:
    print("| %s | %.0f | %.2f | %.2f | %d | %.2f |" % (name, instr, instr / native_instr, instr / fp32_instr, ops, ops / native_ops))
PY
