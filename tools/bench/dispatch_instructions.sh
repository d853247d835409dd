#!/usr/bin/env bash
# SPDX-License-Identifier: BSD-3-Clause
# Instructions per call: plain LibTorch, native autocast, amp O1, amp O1 with
# overflow provenance, amp O1 with the measured policy (callgrind).
# Usage: tools/bench/dispatch_instructions.sh [build dir]   (after tools/setup.sh)
set -euo pipefail
build=${1:-build}
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
bash "$(dirname "${BASH_SOURCE[0]}")/run_callgrind.sh" "$build" dispatch_instructions "$out"
python3 - "$out" <<'PY'
import glob, re, sys
counts = {}
for path in glob.glob(sys.argv[1] + "/cg.*"):
    text = open(path).read()
    label = re.search(r"^desc: Trigger: Client Request: (.*)$", text, re.M)
    total = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
    if label and total:
        mode, case, calls = label.group(1).split("|")
        counts[(case, mode)] = int(total.group(1)) / int(calls)
o1_cases = ["mm fp32 (casts)", "mm bf16 (no cast)", "linear, cached weight", "cat bf16+fp32", "relu (not intercepted)"]
cases = o1_cases + ["view", "narrow", "t", "index_select"]
print("| op | plain instr/call | native autocast | amp O1 | amp / native | amp added / native added |")
print("|---|---:|---:|---:|---:|---:|")
for case in cases:
    plain, native, ours = (counts[(case, m)] for m in ("plain", "native", "amp"))
    added = "%.3f" % ((ours - plain) / (native - plain)) if native - plain > 50 else "-"
    print("| %s | %.0f | %.0f | %.0f | %.3f | %s |" % (case, plain, native, ours, ours / native, added))

def added_to_amp(title, mode):
    """amp O1 beside amp O1 with one more thing on (`mode`'s dumps)."""
    print()
    print(title)
    print()
    print("| op | amp O1 | amp O1 + %s | added instr/call |" % mode)
    print("|---|---:|---:|---:|")
    for case in cases:
        ours, more = counts[(case, "amp")], counts[(case, mode)]
        print("| %s | %.0f | %.0f | %.0f |" % (case, ours, more, more - ours))

added_to_amp("Overflow provenance on (forward ops record the largest magnitude of what they read and return):",
             "provenance")
print()
print("amp O2 over a model whose weights a forward lowered, on tensors that are not weights:")
print()
print("| op | plain instr/call | amp O2 | added instr/call |")
print("|---|---:|---:|---:|")
for case in cases:
    plain, o2 = counts[(case, "plain")], counts[(case, "o2")]
    print("| %s | %.0f | %.0f | %.0f |" % (case, plain, o2, o2 - plain))

added_to_amp("The measured policy on (its table loaded with bfloat16 for these GEMMs, so they cast as O1 does; "
             "the difference is the lookup):", "policy")
PY
