#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Fails when a source file lacks amp's licence line.

Every C++, CUDA, Python, shell and CMake file under the given folders (or
the given files) must say `SPDX-License-Identifier: BSD-3-Clause` in its
first three lines (after a #! line). Build folders and unpacked third-party
packages are not read. Run from the repository root:

  python3 tools/check_spdx.py amp opt_levels tests examples tools cmake .ci CMakeLists.txt
"""
import os
import sys

LINE = "SPDX-License-Identifier: BSD-3-Clause"
SOURCE_SUFFIXES = (".cpp", ".h", ".cu", ".cuh", ".py", ".sh", ".cmake", ".in")
SOURCE_NAMES = {"CMakeLists.txt", "run"}  # .ci/run
SKIP_FOLDERS = {"__pycache__", "third_party", "third_party_debs", ".git"}


def is_source(name):
    return name.endswith(SOURCE_SUFFIXES) or name in SOURCE_NAMES


def sources(paths):
    for path in paths:
        if os.path.isfile(path):
            yield path
            continue
        for folder, subfolders, names in os.walk(path):
            subfolders[:] = [s for s in subfolders if s not in SKIP_FOLDERS and not s.startswith("build")]
            yield from (os.path.join(folder, n) for n in sorted(names) if is_source(n))


def has_line(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        head = [f.readline() for _ in range(3)]
    return any(LINE in line for line in head)


def main(paths):
    checked = list(sources(paths))
    missing = [p for p in checked if not has_line(p)]
    for path in missing:
        print(f"{path}: no '{LINE}' line in its first three lines; add one as the first comment")
    print(f"check_spdx: {len(checked)} source files, {len(missing)} without the licence line")
    return 1 if missing or not checked else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["."]))
