#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Fails when code in amp/src reaches a layer above its own.

The library's private code lives in one folder per layer, lowest first
(README "Where things are"). A layer may use its own code, the layers below
it, and the public headers (amp/include). Checked:

- includes, in either form (`#include "step/guard.h"`, `#include <step/guard.h>`:
  amp/src is on the include path, so both reach a private header); a public
  header includes no private one;
- with --objects DIR (repeatable: the build's object folders of the library,
  e.g. build/CMakeFiles/amp.dir): calls, at link time - a symbol an object
  of one layer needs that only objects of layers above it define. An object
  belongs to the layer of the sources it compiles: its own path
  (.../amp/src/<layer>/x.cpp.o), or for a unity object the sources its
  generated .cxx includes. The check refuses what it cannot read: an object
  whose sources span layers (its calls cannot be told apart: the build must
  group unity sources by layer), and a source of amp/src that no object
  compiles;
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
    ("loss", "the fused linear + cross-entropy"),
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


SOURCE_LAYER = re.compile(r"^(?:.*/)?amp/src/([^/]+)/(.+)$")  # the last amp/src/ of a path


def source_layer(path):
    """(layer, path under amp/src) of a source path, or None outside amp/src."""
    m = SOURCE_LAYER.match(path.replace(os.sep, "/"))
    return (m.group(1), f"{m.group(1)}/{m.group(2)}") if m else None


def compiled_sources(obj):
    """The amp/src sources object `obj` compiles: those its unity file
    (the object's name less .o, beside it) includes, else its own."""
    unity = obj[:-2]
    if os.path.basename(unity).startswith("unity_") and os.path.exists(unity):
        with open(unity, encoding="utf-8") as f:
            sources = [m.group(2) for m in (INCLUDE.match(line) for line in f) if m]
    else:
        sources = [unity]
    return [layer for layer in map(source_layer, sources) if layer]


def library_sources(root):
    """Every source file of amp/src, as 'layer/path'."""
    src = os.path.join(root, "amp", "src")
    found = set()
    for directory, _, files in os.walk(src):
        for name in files:
            if name.endswith((".cpp", ".cu")):
                found.add(os.path.relpath(os.path.join(directory, name), src).replace(os.sep, "/"))
    return found


def object_files(places):
    """The .o files of `places`: files, folders (searched), or ';'-separated
    lists of either (as CMake's $<TARGET_OBJECTS> gives them)."""
    for place in (p for entry in places for p in entry.split(";") if p):
        if os.path.isdir(place):
            for directory, _, files in sorted(os.walk(place)):
                yield from (os.path.join(directory, n) for n in sorted(files) if n.endswith(".o"))
        elif place.endswith(".o"):
            yield place


def shown_object(path):
    """An object's path from its target's folder on (x.dir/...)."""
    parts = path.replace(os.sep, "/").split("/")
    tops = [i for i, part in enumerate(parts) if part.endswith(".dir")]
    return "/".join(parts[tops[-1]:]) if tops else path


def check_links(root, places):
    definers = defaultdict(set)
    needs, problems, compiled = [], [], set()
    for path in object_files(places):
        shown = shown_object(path)
        sources = compiled_sources(path)
        layers = sorted({layer for layer, _ in sources}, key=lambda layer: RANK.get(layer, -1))
        compiled.update(source for _, source in sources)
        if not layers:
            continue  # not the library's (a precompiled header's object)
        if len(layers) > 1 or layers[0] not in RANK:
            problems.append(f"{shown}: compiles sources of {', '.join(layers)}: an object must hold one "
                            "layer's code (CMakeLists.txt groups the unity build by layer)")
            continue
        defined, needed = symbols(path)
        for symbol in defined:
            definers[symbol].add(layers[0])
        needs.append((layers[0], shown, needed))
    if not needs:
        return ["--objects: no object files of amp/src's layers (build the library first)"]
    # .cu sources are compiled only where CUDA kernels are built.
    missing = sorted(s for s in library_sources(root) - compiled if s.endswith(".cpp"))
    problems += [f"amp/src/{source}: no object given compiles it, so its calls go unchecked" for source in missing]
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
    parser.add_argument("--objects", action="append", default=[],
                        help="a folder of the build's objects of the library (repeatable)")
    args = parser.parse_args()
    problems = check_includes(args.root) + check_readme(args.root)
    if args.objects:
        problems += check_links(args.root, args.objects)
    if problems:
        print("\n".join(problems))
        print(f"check_layers: {len(problems)} problem(s) against the layer order", file=sys.stderr)
        return 1
    checked = "every include" + (" and every call between layers" if args.objects else "")
    print(f"check_layers: {checked} points down: {layer_line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
