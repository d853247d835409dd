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


def fails(added, expected):
    """The check fails on `down` with `added` text appended to its files
    (new files where absent), saying `expected`."""
    files = dict(down)
    for path, text in added.items():
        files[path] = files.get(path, "") + text
    code, out = run(files)
    assert code == 1 and expected in out, out


fails({"amp/src/step/guard.cpp": '#include "distributed/sharded_optimizer.h"\n'},
      "amp/src/step/guard.cpp:3: layer 'step' includes \"distributed/sharded_optimizer.h\" from 'distributed'")
fails({"amp/src/misc/helper.cpp": "\n"}, "amp/src/misc: not a layer")
fails({"amp/include/amp/amp.h": '#include "step/guard.h"\n'}, "a public header includes a private one")

# Angle brackets reach amp/src too: an upward one fails, as does a private
# header in a public one; other libraries' headers pass.
fails({"amp/src/step/guard.cpp": "#include <distributed/sharded_optimizer.h>\n#include <ATen/ATen.h>\n"},
      "layer 'step' includes <distributed/sharded_optimizer.h> from 'distributed'")
fails({"amp/include/amp/amp.h": "#include <model/model_weights.h>\n"},
      "a public header includes a private one (model/model_weights.h)")

# The README's layer line is the table's.
fails({"README.md": "`support <- model <- step`\n"}, "README.md: its layer line is not")


def link(sources):
    """Compiles each amp/src/<layer>/<name>.cpp of `sources` into objects,
    laid out as the build lays them, and runs the check over them."""
    with tempfile.TemporaryDirectory() as root:
        tree(root, {**down, **sources})
        objects = os.path.join(root, "objects")
        for path in sources:
            layer, name = path.split("/")[2], os.path.basename(path)
            os.makedirs(os.path.join(objects, layer), exist_ok=True)
            subprocess.run(["c++", "-c", os.path.join(root, path), "-o",
                            os.path.join(objects, layer, name + ".o")], check=True)
        done = subprocess.run([sys.executable, CHECK, root, "--objects", objects], capture_output=True, text=True)
        return done.returncode, done.stdout + done.stderr


# A call down links; a call up (optim calling what step defines) fails,
# though no include shows it.
code, out = link({"amp/src/step/scaler.cpp": "int unscale(int x) { return x / 2; }\n",
                  "amp/src/session/context.cpp": "int unscale(int);\nint run() { return unscale(4); }\n"})
assert code == 0, out
code, out = link({"amp/src/step/scaler.cpp": "int unscale(int x) { return x / 2; }\n",
                  "amp/src/optim/plan.cpp": "int unscale(int);\nint run() { return unscale(4); }\n"})
assert code == 1 and "plan.cpp.o: layer 'optim' calls unscale(int), defined in 'step'" in out, out
print("check_layers_test: 9 cases passed")
