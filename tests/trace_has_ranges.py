# SPDX-License-Identifier: BSD-3-Clause
"""Exits 0 when the Chrome trace FILE holds every range named after it."""
import json
import sys

path, *wanted = sys.argv[1:]
with open(path) as f:
    names = {event.get("name") for event in json.load(f)["traceEvents"]}
missing = [name for name in wanted if name not in names]
if missing:
    sys.exit(f"{path} lacks the ranges {missing}")
print(f"{path} holds {len(wanted)} ranges")
