#!/usr/bin/env python3
"""Fails when code in amp/src reaches a layer above its own.

The library's private code lives in one folder per layer, lowest first
(README "Where things are"). A layer may use its own code, the layers below
it, and the public headers (amp/include). Checked:

- includes, in either form (`#include "step/guard.h"`, `#include <step/guard.h>`:
  amp/src is on the include path, so both reach a private header); a public
  header includes no private one;
- with --objects DIR (the build's objects of amp/src, e.g.
  build/CMakeFiles/amp.dir/amp/src): calls, at link time - a symbol an object
  of one layer needs that only objects of layers above it define;
- the README's layer line: it is the one this table prints.

Run from the repository root or with the root as the first argument; prints
each problem and exits 1, or prints the layer order and exits 0.
"""
import argparse
import os
import re
import subprocess
import sys
from collections import defaultdict

# Lowest first. Each entry: the folder under amp/src, and what it holds.
LAYERS = [
    ("support", "logging, profiler ranges, host reads, graph-capture state, the live sessions' slots"),
    ("autograd", "graph pieces shared by recomputation, provenance, reduction and the step in backward"),
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
RANK = {name: i for i, (name, _) in enumerate(LAYERS)}
INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def layer_line():
    return " <- ".join(name for name, _ in LAYERS)


def includes(path):
    """(line number, form, target) of each include in `path`."""
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            m = INCLUDE.match(line)
            if m:
                yield number, m.group(1), m.group(2)


def check_includes(root):
    problems = []
    src = os.path.join(root, "amp", "src")
    for folder in sorted(os.listdir(src)):
        if folder not in RANK:
            problems.append(f"amp/src/{folder}: not a layer; add it to LAYERS in tools/check_layers.py")
            continue
        for directory, _, files in os.walk(os.path.join(src, folder)):
            for name in sorted(files):
                path = os.path.join(directory, name)
                shown = os.path.relpath(path, root)
                for number, form, target in includes(path):
                    top = target.split("/")[0]
                    if top not in RANK:
                        if form == '"':
                            problems.append(f"{shown}:{number}: includes \"{target}\", outside every layer")
                    elif RANK[top] > RANK[folder]:
                        shown_target = f'"{target}"' if form == '"' else f"<{target}>"
                        problems.append(f"{shown}:{number}: layer '{folder}' includes {shown_target} "
                                        f"from '{top}', a layer above it")
    public = os.path.join(root, "amp", "include", "amp")
    for directory, _, files in os.walk(public):
        for name in sorted(files):
            path = os.path.join(directory, name)
            for number, form, target in includes(path):
                if form == '"' or target.split("/")[0] in RANK:
                    problems.append(f"{os.path.relpath(path, root)}:{number}: a public header includes "
                                    f"a private one ({target})")
    return problems


def symbols(path):
    """(defined, needed): the symbols `path` defines for good, and those it needs."""
    out = subprocess.run(["nm", "-P", path], capture_output=True, text=True, check=True).stdout
    defined, needed = set(), set()
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        if fields[1] == "U":
            needed.add(fields[0])
        elif fields[1] in "TDBR":  # weak and inline copies do not count: every user has one
            defined.add(fields[0])
    return defined, needed


def check_links(objects):
    definers = defaultdict(set)
    needs = []
    for folder in sorted(os.listdir(objects)):
        if folder not in RANK:
            continue
        for directory, _, files in os.walk(os.path.join(objects, folder)):
            for name in sorted(files):
                if not name.endswith(".o"):
                    continue
                path = os.path.join(directory, name)
                defined, needed = symbols(path)
                for symbol in defined:
                    definers[symbol].add(folder)
                needs.append((folder, os.path.relpath(path, objects), needed))
    if not needs:
        return [f"{objects}: no object files of amp/src's layers (build the library first)"]
    problems = []
    for folder, shown, needed in needs:
        for symbol in sorted(needed):
            layers = definers.get(symbol)
            if layers and all(RANK[layer] > RANK[folder] for layer in layers):
                name = subprocess.run(["c++filt", symbol], capture_output=True, text=True).stdout.strip()
                above = min(layers, key=RANK.get)
                problems.append(f"{shown}: layer '{folder}' calls {name}, defined in '{above}', a layer above it")
    return problems


def check_readme(root):
    readme = os.path.join(root, "README.md")
    if not os.path.exists(readme):
        return []
    with open(readme, encoding="utf-8") as f:
        if f"`{layer_line()}`" in f.read():
            return []
    return [f"README.md: its layer line is not `{layer_line()}` (tools/check_layers.py's LAYERS)"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", nargs="?", default=".")
    parser.add_argument("--objects", help="the build's object files of amp/src, one folder per layer")
    args = parser.parse_args()
    problems = check_includes(args.root) + check_readme(args.root)
    if args.objects:
        problems += check_links(args.objects)
    if problems:
        print("\n".join(problems))
        print(f"check_layers: {len(problems)} problem(s) against the layer order", file=sys.stderr)
        return 1
    checked = "every include" + (" and every call between layers" if args.objects else "")
    print(f"check_layers: {checked} points down: {layer_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
