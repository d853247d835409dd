#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Compares training curves step by step: the examples' --csv files
(step,loss,loss_scale), each against a reference run.

    tools/compare_curves.py [--max_diff=D] REFERENCE.csv RUN.csv [RUN.csv ...]

For each run: its final loss (the mean of the last 50 steps, less noisy than
the last step), and the difference of its loss from the reference's at the
same step - the mean over all steps, the largest, and the mean of the last
100 steps. Two runs on the same batches that differ only in rounding start
equal and drift apart slowly; runs on other batches (another --seed) differ
by the batches' own spread from the first step. With --max_diff, exits 1
when a run's largest difference exceeds D.
"""
import argparse
import csv
import sys


def read(path):
    with open(path, newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def mean(values):
    return sum(values) / len(values)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max_diff", type=float, help="fail when a run's loss differs by more at any step")
    parser.add_argument("reference")
    parser.add_argument("runs", nargs="+")
    args = parser.parse_args()
    reference = read(args.reference)
    print(f"reference: {args.reference} ({len(reference)} steps)")
    print("| run | steps | final loss (last 50) | mean |diff| | max |diff| | mean |diff|, last 100 |")
    print("|---|---:|---:|---:|---:|---:|")
    too_far = []
    for path in [args.reference] + args.runs:
        loss = read(path)
        if len(loss) != len(reference) or not loss:
            sys.exit(f"{path} has {len(loss)} steps, the reference {len(reference)}: compare runs of the same length")
        diff = [abs(a - b) for a, b in zip(loss, reference)]
        print(f"| {path} | {len(loss)} | {mean(loss[-50:]):.4f} | {mean(diff):.4f} | {max(diff):.4f} | "
              f"{mean(diff[-100:]):.4f} |")
        if args.max_diff is not None and max(diff) > args.max_diff:
            too_far.append(f"{path}: {max(diff):.4f} at step {diff.index(max(diff)) + 1}")
    if too_far:
        sys.exit(f"runs farther than --max_diff={args.max_diff} from the reference: " + "; ".join(too_far))


if __name__ == "__main__":
    main()
