#!/usr/bin/env python3
"""tools/check_layers.py passes a tree whose includes point down and fails,
naming the file and both layers, one with an include pointing up."""
import os
import subprocess
import sys
import tempfile

CHECK = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tools", "check_layers.py")


def tree(root, files):
    for path, text in files.items():
        full = os.path.join(root, path)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w", encoding="utf-8") as f:
            f.write(text)


def run(files):
    with tempfile.TemporaryDirectory() as root:
        tree(root, files)
        done = subprocess.run([sys.executable, CHECK, root], capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr


down = {"amp/include/amp/amp.h": "#include <amp/scale_loss.h>\n",
        "amp/src/step/guard.cpp": '#include "step/guard.h"\n#include "optim/unscale_plan.h"\n',
        "amp/src/session/context.cpp": '#include "step/guard.h"\n#include "distributed/x.h"\n'}
code, out = run(down)
assert code == 0, out

up = dict(down)
up["amp/src/step/guard.cpp"] += '#include "distributed/sharded_optimizer.h"\n'
code, out = run(up)
assert code == 1, out
assert "amp/src/step/guard.cpp:3: layer 'step' includes \"distributed/sharded_optimizer.h\" from 'distributed'" in out, out

stray = dict(down)
stray["amp/src/misc/helper.cpp"] = "\n"
code, out = run(stray)
assert code == 1 and "amp/src/misc: not a layer" in out, out

private_in_public = dict(down)
private_in_public["amp/include/amp/amp.h"] += '#include "step/guard.h"\n'
code, out = run(private_in_public)
assert code == 1 and "a public header includes a private one" in out, out
print("check_layers_test: 4 cases passed")
