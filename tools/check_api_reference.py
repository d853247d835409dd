#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""Checks amp's API reference: Doxygen documents every public name.

Runs Doxygen with the configured Doxyfile (cmake/docs.cmake writes it from
docs/Doxyfile.in), which warns for every public name without documentation
and for malformed comments, and fails on any warning. The HTML goes to a
temporary folder, so the check leaves the build's `docs` output alone.

  python3 tools/check_api_reference.py --doxygen doxygen --doxyfile build/Doxyfile

With --plant it proves the check can fail: it copies the public header
folders (the Doxyfile's INPUT folders) to a temporary folder, at the same
paths below the source root (STRIP_FROM_PATH), appends an undocumented
declaration, `namespace amp { int undocumented_planted_name(); }`, to one
header there, and runs Doxygen with the same settings on the copy. It
passes only when Doxygen fails and names the planted declaration.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

PLANTED = "undocumented_planted_name"
PLANT = f"\nnamespace amp {{\nint {PLANTED}();\n}}  // namespace amp\n"


def config_value(text, key):
    """A Doxyfile tag's value as a list of words (continuation lines joined, quotes honoured)."""
    text = re.sub(r"\\\n", " ", text)
    value = None
    for line in text.splitlines():
        m = re.match(rf"\s*{key}\s*(\+?=)(.*)$", line)
        if m:
            words = re.findall(r'"([^"]*)"|(\S+)', m.group(2))
            words = [a or b for a, b in words]
            value = (value or []) + words if m.group(1) == "+=" else words
    return value or []


def quoted(path):
    return '"' + path + '"'


def run_doxygen(doxygen, config_text, overrides):
    """Runs Doxygen on `config_text` with `overrides` (tag: value) appended; (exit code, output, seconds)."""
    config = config_text + "\n" + "".join(f"{key} = {value}\n" for key, value in overrides.items())
    start = time.monotonic()
    result = subprocess.run([doxygen, "-"], input=config, capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr, time.monotonic() - start


def warnings_in(output):
    return [line for line in output.splitlines() if re.search(r": (warning|error): ", line)]


def check_real(doxygen, config_text, work):
    code, output, seconds = run_doxygen(doxygen, config_text, {"OUTPUT_DIRECTORY": quoted(work)})
    warnings = warnings_in(output)
    if warnings or code != 0:
        sys.stdout.write(output)
        print(f"check_api_reference: Doxygen exited {code} with {len(warnings)} warnings: document "
              "each name it lists (a `///` comment before it, or `///<` after a member)")
        return 1
    print(f"check_api_reference: every public name is documented (0 warnings, {seconds:.1f} s)")
    return 0


def check_planted(doxygen, config_text, work):
    folders = [path for path in config_value(config_text, "INPUT") if os.path.isdir(path)]
    if not folders:
        print("check_api_reference: the Doxyfile's INPUT names no folder of headers")
        return 1
    # The copies keep their paths below the source root, so that the
    # Doxyfile's exclude patterns and include paths apply to them alike.
    root = (config_value(config_text, "STRIP_FROM_PATH") or [os.path.commonpath(folders)])[0]
    copied = os.path.join(work, "src")

    def copy_of(path):
        relative = os.path.relpath(path, root)
        return os.path.join(copied, relative if not relative.startswith("..") else os.path.basename(path))

    inputs = []
    for folder in folders:
        shutil.copytree(folder, copy_of(folder))
        inputs.append(copy_of(folder))
    public = sorted(os.path.join(inputs[0], name) for name in os.listdir(inputs[0]) if name.endswith(".h"))
    if not public:
        print(f"check_api_reference: no header in {folders[0]}")
        return 1
    target = public[0]
    with open(target, "a", encoding="utf-8") as f:
        f.write(PLANT)
    # The copies replace the folders; files in INPUT (the main page) stay.
    files = [path for path in config_value(config_text, "INPUT") if not os.path.isdir(path)]
    code, output, _ = run_doxygen(doxygen, config_text, {
        "INPUT": " ".join(quoted(path) for path in files + inputs),
        "OUTPUT_DIRECTORY": quoted(os.path.join(work, "out")),
        "STRIP_FROM_PATH": quoted(copied),
        "STRIP_FROM_INC_PATH": " ".join(quoted(copy_of(path))
                                        for path in config_value(config_text, "STRIP_FROM_INC_PATH")),
    })
    named = [line for line in warnings_in(output) if PLANTED in line]
    if code != 0 and named:
        print(f"check_api_reference: Doxygen failed (exit {code}) on the undocumented name planted in "
              f"{os.path.basename(target)}:\n  {named[0]}")
        return 0
    sys.stdout.write(output)
    print(f"check_api_reference: Doxygen exited {code} and {'named' if named else 'did not name'} "
          f"{PLANTED}: the check would not catch an undocumented public name")
    return 1


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doxygen", default="doxygen", help="the doxygen executable")
    parser.add_argument("--doxyfile", required=True, help="the configured Doxyfile")
    parser.add_argument("--plant", action="store_true",
                        help="check that an undocumented name planted in a copy of the headers fails")
    args = parser.parse_args()
    with open(args.doxyfile, encoding="utf-8") as f:
        config_text = f.read()
    with tempfile.TemporaryDirectory(prefix="amp_api_reference_") as work:
        return (check_planted if args.plant else check_real)(args.doxygen, config_text, work)


if __name__ == "__main__":
    sys.exit(main())
