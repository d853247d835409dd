#!/usr/bin/env python3
# SPDX-License-Identifier: BSD-3-Clause
"""tools/check_layers.py passes a tree whose includes point down and fails,
naming the file and both layers, one with an include pointing up; against
the real build's objects it passes, and fails on an upward call planted in
a copy of them (compiled with the build's own command), on an object that
mixes layers, and on a layer whose objects are missing.

    check_layers_test.py BUILD_DIR OBJECTS...   (the library's objects, as
                                                 $<TARGET_OBJECTS> lists them)
"""
import json
import os
import shlex
import shutil
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



# ---- The link-time check, on the objects the build makes ---------------------

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
build, objects = sys.argv[1], [o for arg in sys.argv[2:] for o in arg.split(";") if o]
sys.path.insert(0, os.path.dirname(CHECK))
import check_layers  # noqa: E402


def layer_of(obj):
    layers = {layer for layer, _ in check_layers.compiled_sources(obj)}
    assert len(layers) == 1, f"{obj}: {layers}"
    return layers.pop()


def check(root, objs):
    done = subprocess.run([sys.executable, CHECK, root, "--objects", ";".join(objs)], capture_output=True, text=True)
    return done.returncode, done.stdout + done.stderr


by_layer = {}
for obj in objects:
    if check_layers.compiled_sources(obj):
        by_layer.setdefault(layer_of(obj), []).append(obj)
assert set(by_layer) == set(check_layers.RANK), f"the build's objects cover {sorted(by_layer)}"
code, out = check(ROOT, objects)
assert code == 0, out


def compile_command(unity_object, source, output):
    """The build's command for `unity_object`, compiling `source` into `output`."""
    with open(os.path.join(build, "compile_commands.json"), encoding="utf-8") as f:
        entries = json.load(f)
    unity = os.path.abspath(unity_object[:-2])
    entry = next(e for e in entries if os.path.abspath(os.path.join(e["directory"], e["file"])) == unity)
    words = entry.get("arguments") or shlex.split(entry["command"])
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("-o", "-c", "-MT", "-MF"):
            skip = True
        elif word != "-MD":
            kept.append(word)
    return kept + ["-c", source, "-o", output], entry["directory"]


with tempfile.TemporaryDirectory() as tmp:
    root = os.path.join(tmp, "tree")
    for part in ("amp/src", "amp/include"):
        shutil.copytree(os.path.join(ROOT, part), os.path.join(root, part))
    shutil.copy(os.path.join(ROOT, "README.md"), root)

    # An upward call and include planted in the lowest layer: support reaching
    # the session's Context, compiled as the build compiles support.
    planted = os.path.join(root, "amp/src/support/planted_upward_call.cpp")
    with open(planted, "w", encoding="utf-8") as f:
        f.write('#include "session/context.h"\n\n'
                "namespace amp::detail {\n"
                "std::shared_ptr<internal::LossScaling> planted_upward_call(Context& context) {\n"
                "  return context.shared_scaler(0);\n}\n}  // namespace amp::detail\n")
    planted_object = os.path.join(tmp, "objects/amp/src/support/planted_upward_call.cpp.o")
    os.makedirs(os.path.dirname(planted_object))
    command, directory = compile_command(by_layer["support"][0], planted, planted_object)
    subprocess.run(command, cwd=directory, check=True)
    code, out = check(root, objects + [planted_object])
    assert code == 1, out
    assert ("amp/src/support/planted_upward_call.cpp:1: layer 'support' includes \"session/context.h\" from 'session'"
            in out), out
    assert ("planted_upward_call.cpp.o: layer 'support' calls amp::detail::Context::shared_scaler(int), "
            "defined in 'session', a layer above it") in out, out
    assert "no object given compiles" not in out, out

    # A unity object whose sources span two layers cannot be read.
    mixed = os.path.join(tmp, "mixed/CMakeFiles/amp.dir/Unity/unity_support_cxx.cxx")
    os.makedirs(os.path.dirname(mixed))
    support_object = by_layer["support"][0]
    shutil.copy(support_object[:-2], mixed)
    shutil.copy(support_object, mixed + ".o")
    with open(mixed, "a", encoding="utf-8") as f:
        f.write(f'#include "{os.path.join(ROOT, "amp/src/session/context.cpp")}"\n')
    code, out = check(ROOT, [o for o in objects if o != support_object] + [mixed + ".o"])
    assert code == 1 and "unity_support_cxx.cxx.o: compiles sources of support, session" in out, out

    # A layer with no objects given: its sources go unchecked, so the check fails.
    code, out = check(ROOT, [o for o in objects if o not in by_layer["persistence"]])
    assert code == 1 and "amp/src/persistence/state.cpp: no object given compiles it" in out, out

print("check_layers_test: 10 cases passed, 4 on the build's own objects")
