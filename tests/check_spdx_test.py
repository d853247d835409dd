#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""The licence check fails on a source file without the licence line.

Plants a C++ file without the line in the real source tree (tools/, where
the check reads it as CI does) and runs tools/check_spdx.py over the same
folders as ctest's every_source_file_names_its_licence: it must exit 1 and
name the planted file alone. The file is removed afterwards. (ctest keeps
the two tests apart: RESOURCE_LOCK source_tree.)
"""
import os
import subprocess
import sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
checker = os.path.join(root, "tools", "check_spdx.py")
planted = os.path.join("tools", f"planted_unlicensed_{os.getpid()}.cpp")
folders = ["amp", "opt_levels", "tests", "examples", "tools", "cmake", ".ci", "CMakeLists.txt"]
with open(os.path.join(root, planted), "w") as f:
    f.write("// a source file\nint planted() { return 0; }\n")
try:
    run = subprocess.run([sys.executable, checker, *folders], cwd=root, capture_output=True, text=True)
finally:
    os.remove(os.path.join(root, planted))
print(run.stdout, end="")
named = [line for line in run.stdout.splitlines() if "no 'SPDX" in line]
ok = run.returncode == 1 and len(named) == 1 and planted in named[0]
print("check_spdx fails on the planted file only" if ok else "check_spdx did NOT catch the planted file")
sys.exit(0 if ok else 1)
