#!/usr/bin/env python3
"""Fails when a file in amp/src includes a layer above its own.

The library's private code lives in one folder per layer, lowest first
(README "Where things are"). A layer may include its own headers, those of
the layers below it, and the public headers (amp/include). Run from the
repository root or with the root as the only argument; prints each
offending include and exits 1, or prints the layer order and exits 0.
"""
import os
import re
import sys

# Lowest first. Each entry: the folder under amp/src, and what it holds.
LAYERS = [
    ("support", "logging, profiler ranges, host reads, graph-capture state"),
    ("autograd", "graph pieces shared by recomputation and provenance"),
    ("model", "converted models and their weights"),
    ("fp8", "float8 GEMMs: per-operand scaling, the linear layer's forward and backward"),
    ("interception", "dispatcher kernels, cast policies and tables, the cast cache"),
    ("optim", "optimizer kinds and state, gradient slots, unscaling, fused kernels"),
    ("step", "scale_loss, loss scalers, the step's state machine and participants"),
    ("recompute", "activation recomputation"),
    ("fused", "the fused optimizers' step()"),
    ("distributed", "data parallel: reduction and sharding, as step participants"),
    ("session", "the live context and initialize"),
    ("persistence", "checkpoints and amp's state"),
]
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"')


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    src = os.path.join(root, "amp", "src")
    rank = {name: i for i, (name, _) in enumerate(LAYERS)}
    problems = []
    for folder in sorted(os.listdir(src)):
        if folder not in rank:
            problems.append(f"amp/src/{folder}: not a layer; add it to LAYERS in tools/check_layers.py")
            continue
        for directory, _, files in os.walk(os.path.join(src, folder)):
            for name in sorted(files):
                path = os.path.join(directory, name)
                shown = os.path.relpath(path, root)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        m = INCLUDE.match(line)
                        if not m:
                            continue
                        target = m.group(1).split("/")[0]
                        if target not in rank:
                            problems.append(f"{shown}:{number}: includes \"{m.group(1)}\", outside every layer")
                        elif rank[target] > rank[folder]:
                            problems.append(f"{shown}:{number}: layer '{folder}' includes \"{m.group(1)}\" "
                                            f"from '{target}', a layer above it")
    public = os.path.join(root, "amp", "include", "amp")
    for directory, _, files in os.walk(public):
        for name in sorted(files):
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    if INCLUDE.match(line):
                        problems.append(f"{os.path.relpath(path, root)}:{number}: a public header includes "
                                        "a private one")
    if problems:
        print("\n".join(problems))
        print(f"check_layers: {len(problems)} include(s) against the layer order", file=sys.stderr)
        return 1
    print("check_layers: every include points down: " + " <- ".join(n for n, _ in LAYERS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
