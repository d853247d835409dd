#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""The licence check fails on a source file without the licence line.

Runs tools/check_spdx.py on a folder holding one file with the line (after
a #! line) and one without: it must exit 1 and name only the one without.
"""
import os
import subprocess
import sys
import tempfile

checker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "check_spdx.py")
with tempfile.TemporaryDirectory() as folder:
    with open(os.path.join(folder, "licensed.sh"), "w") as f:
        f.write("#!/bin/sh\n# SPDX-License-Identifier: BSD-3-Clause\necho\n")
    with open(os.path.join(folder, "unlicensed.cpp"), "w") as f:
        f.write("// a source file\nint main() {}\n")
    run = subprocess.run([sys.executable, checker, folder], capture_output=True, text=True)
    print(run.stdout, end="")
    named = [line for line in run.stdout.splitlines() if "no 'SPDX" in line]
    ok = run.returncode == 1 and len(named) == 1 and "unlicensed.cpp" in named[0]
print("check_spdx fails on the unlicensed file only" if ok else "check_spdx did NOT catch the unlicensed file")
sys.exit(0 if ok else 1)
