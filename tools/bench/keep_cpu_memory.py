# SPDX-License-Identifier: BSD-3-Clause
"""amp's Options::keep_cpu_memory, measured: the examples with it on and off
beside Python's torch.amp (with glibc's defaults, and with the same malloc
settings given by environment), in interleaved rounds; prints a Markdown
table of medians (ms/step and page faults per step) and the ratios.

  .venv/bin/python tools/bench/keep_cpu_memory.py [--rounds=3] [--steps=150] [--train_limit=10000]

Runs build/examples (tools/setup.sh builds them) and tools/bench/peer_examples.py.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUILD = os.environ.get("AMP_BUILD_DIR", os.path.join(ROOT, "build"))
PEER = [sys.executable, "-W", "ignore", os.path.join(ROOT, "tools/bench/peer_examples.py")]
# What keep_cpu_memory sets, as glibc's environment tunables.
GLIBC_KEPT = {"MALLOC_MMAP_THRESHOLD_": str(32 << 20), "MALLOC_TRIM_THRESHOLD_": str(2**31 - 1)}


def run(command, env_extra=None):
    """ms/step and peak RSS from the summary line, and the process's minor page faults."""
    env = dict(os.environ, **(env_extra or {}))
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status != 0:
        sys.exit(f"failed ({status}): {' '.join(command)}")
    ms = float(re.search(r"ms/step ([0-9.]+)", out).group(1))
    return ms, float(re.search(r"peak RSS ([0-9.]+)", out).group(1)), usage.ru_minflt


def variants(args):
    transformer = [f"--steps={args.steps}"]
    cnn = [f"--train_limit={args.train_limit}"]
    amp_t = [os.path.join(BUILD, "examples/transformer_lm"), "--sample_chars=1", "--verbosity=0"] + transformer
    amp_c = [os.path.join(BUILD, "examples/fashion_mnist"), "--verbosity=0"] + cnn
    out = []
    for model, amp, peer_model, peer_args in (("character transformer", amp_t, "transformer", transformer),
                                              ("Fashion-MNIST CNN", amp_c, "fashion_mnist", cnn)):
        for level in ("O0", "O1"):
            out.append((model, f"amp {level}, kept (default)", amp + [f"--opt_level={level}"], None))
            out.append((model, f"amp {level}, keep_cpu_memory=false", amp + [f"--opt_level={level}", "--keep_cpu_memory=false"], None))
        for mode in ("fp32", "autocast"):
            out.append((model, f"torch.amp {mode}", PEER + [peer_model, mode] + peer_args, None))
            out.append((model, f"torch.amp {mode}, glibc set as amp sets it", PEER + [peer_model, mode] + peer_args, GLIBC_KEPT))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--train_limit", type=int, default=10000)
    args = parser.parse_args()
    runs = variants(args)
    times = {i: [] for i in range(len(runs))}
    faults = {i: [] for i in range(len(runs))}
    rss = {i: [] for i in range(len(runs))}
    for _ in range(args.rounds):
        for i, (_, _, command, env) in enumerate(runs):
            ms, peak_rss, minflt = run(command, env)
            times[i].append(ms)
            rss[i].append(peak_rss)
            faults[i].append(minflt)
    print(f"Medians of {args.rounds} interleaved rounds; page faults are the whole process's.")
    print()
    print("| model | run | ms/step | runs | page faults (whole run) | peak RSS (MiB) |")
    print("|---|---|---:|---|---:|---:|")
    medians = {}
    for i, (model, what, _, _) in enumerate(runs):
        medians[(model, what)] = statistics.median(times[i])
        spread = ", ".join(f"{t:.1f}" for t in times[i])
        print(f"| {model} | {what} | {medians[(model, what)]:.1f} | {spread} | {statistics.median(faults[i]):,.0f} | {statistics.median(rss[i]):.0f} |")
    print()
    print("| model | amp O1 kept / torch.amp autocast | amp O1 kept / amp O1 not kept | amp O1 kept / torch.amp autocast, glibc set alike |")
    print("|---|---:|---:|---:|")
    for model in dict.fromkeys(m for m, _, _, _ in runs):
        o1 = medians[(model, "amp O1, kept (default)")]
        print(f"| {model} | {o1 / medians[(model, 'torch.amp autocast')]:.2f} | "
              f"{o1 / medians[(model, 'amp O1, keep_cpu_memory=false')]:.2f} | "
              f"{o1 / medians[(model, 'torch.amp autocast, glibc set as amp sets it')]:.2f} |")


if __name__ == "__main__":
    main()
