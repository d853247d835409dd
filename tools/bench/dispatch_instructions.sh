#!/usr/bin/env bash
# Instructions per call: plain LibTorch, native autocast, amp O1, amp O1 with
# overflow provenance, amp O1 with the measured policy (callgrind).
# Usage: tools/bench/dispatch_instructions.sh [build dir]   (after tools/setup.sh)
set -euo pipefail
build=${1:-build}
command -v valgrind >/dev/null || { echo "needs valgrind (apt-get install valgrind)" >&2; exit 1; }
[[ -x "$build/tools/dispatch_instructions" ]] || { echo "no $build/tools/dispatch_instructions: build it first" >&2; exit 1; }
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
valgrind --tool=callgrind --collect-atstart=yes --callgrind-out-file="$out/cg.%p" \
  "$build/tools/dispatch_instructions" 2>"$out/log" || { cat "$out/log" >&2; exit 1; }
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
print("| op | plain instr/call | native autocast | amp O1 | amp / native | amp added / native added |")
print("|---|---:|---:|---:|---:|---:|")
for case in ["mm fp32 (casts)", "mm bf16 (no cast)", "linear, cached weight", "cat bf16+fp32", "relu (not intercepted)"]:
    plain, native, ours = (counts[(case, m)] for m in ("plain", "native", "amp"))
    added = "%.3f" % ((ours - plain) / (native - plain)) if native - plain > 50 else "-"
    print("| %s | %.0f | %.0f | %.0f | %.3f | %s |" % (case, plain, native, ours, ours / native, added))
print()
print("Overflow provenance on (forward ops record the largest magnitude of what they read and return):")
print()
print("| op | amp O1 | amp O1 + provenance | added instr/call |")
print("|---|---:|---:|---:|")
for case in ["mm fp32 (casts)", "mm bf16 (no cast)", "linear, cached weight", "cat bf16+fp32", "relu (not intercepted)"]:
    ours, watched = counts[(case, "amp")], counts[(case, "provenance")]
    print("| %s | %.0f | %.0f | %.0f |" % (case, ours, watched, watched - ours))
print()
print("The measured policy on (its table loaded with bfloat16 for these GEMMs, so they cast as O1 does; the difference is the lookup):")
print()
print("| op | amp O1 | amp O1 + policy | added instr/call |")
print("|---|---:|---:|---:|")
for case in ["mm fp32 (casts)", "mm bf16 (no cast)", "linear, cached weight", "cat bf16+fp32", "relu (not intercepted)"]:
    ours, measured = counts[(case, "amp")], counts[(case, "policy")]
    print("| %s | %.0f | %.0f | %.0f |" % (case, ours, measured, measured - ours))
PY
