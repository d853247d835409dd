# SPDX-License-Identifier: BSD-3-Clause
"""The loss layer's Python peers: what a Python user computes a language
model's output layer and its mean cross-entropy with, beside
amp::linear_cross_entropy (tools/bench/gpu_benchmarks.cpp's `loss` table,
tools/bench/memory_benchmark.cpp --loss_layer). Hidden states and the
output weight in bfloat16, under torch.autocast(bfloat16), forward and
backward, as a user writes each:

  plain     F.linear + F.cross_entropy on the float32 logits
  compiled  the same under torch.compile (Inductor fuses the loss; the
            logits are still made whole)
  chunked   torchtune's CEWithChunkedOutputLoss: the tokens in 8 chunks,
            each chunk's logits upcast to float32 on their own (all kept
            for backward)
  liger     Liger Kernel's fused linear cross-entropy
            (liger_kernel.transformers.functional; Triton kernels)

Prints one line a way: "row <way> peak_mib X ms Y loss Z" - the most bytes
allocated at once above the inputs (the gradients of hidden and weight
included, which every way makes), the median time of forward and backward
(CUDA events on a GPU), and the loss. A way that cannot run here prints
"row <way> not_run <why>".

--check compares every way's loss and gradients with float64's at a small
shape on the CPU and exits 1 if one is off; Liger's Triton kernels run
there under Triton's interpreter (TRITON_INTERPRET=1, set by this script
before Triton loads; it needs numpy).

  python loss_layer_peer.py --device=cuda --tokens=8192 --width=768 --vocab=50304
  python loss_layer_peer.py --check
"""
import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time

WAYS = ["plain", "compiled", "chunked", "liger"]


def parse():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="every way against float64 at a small shape, on the CPU")
    return parser.parse_args()


args = parse()
if args.check or args.device == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when Triton loads

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402


def plain(h, w, y):
    return F.cross_entropy(F.linear(h, w).float(), y)


def chunked(h, w, y, chunks=8):
    total = sum(F.cross_entropy(F.linear(hc, w).float(), yc, reduction="sum")
                for hc, yc in zip(h.chunk(chunks), y.chunk(chunks)))
    return total / y.numel()


def way_function(way, device, check=False):
    """The way's loss function, or the reason it cannot run here."""
    if way == "plain":
        return plain
    if way == "chunked":
        return chunked
    if way == "compiled":
        # --check: Dynamo's graph run eagerly (Inductor's C++ build on a CPU takes a minute).
        return torch.compile(plain, backend="eager" if check else "inductor")
    if way == "liger":
        try:
            from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy
        except ImportError as e:
            return f"liger_kernel is not installed ({e})"
        return lambda h, w, y: liger_fused_linear_cross_entropy(h, w, y)
    raise ValueError(f"unknown way {way}")


def run(loss_of, h, w, y, device):
    h.grad = w.grad = None
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_of(h, w, y)
    loss.backward()
    return loss


def measure(loss_of, h, w, y, device, repeats):
    """(peak MiB above the inputs, median ms, loss) of forward and backward."""
    run(loss_of, h, w, y, device)  # warm-up: compilation, autotuning, the allocator's pools
    times, peak = [], 0
    for _ in range(repeats):
        h.grad = w.grad = None
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = run(loss_of, h, w, y, device)
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
            peak = torch.cuda.max_memory_allocated() - before
        else:
            begin = time.perf_counter()
            loss = run(loss_of, h, w, y, device)
            times.append(1000 * (time.perf_counter() - begin))
    if device.type == "cpu":  # the CPU allocator's peak, from the profiler's memory events (as memory_peer.py)
        h.grad = w.grad = None  # freed before, not during, the profile: its counts start from the inputs
        del loss
        gc.collect()
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss = run(loss_of, h, w, y, device)
        path = tempfile.mktemp(suffix=".json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        os.remove(path)
        # "Total Allocated" counts on from the process's earlier profiles
        # (blocks they saw allocated and freed after them stay counted): the
        # peak is above the count before this profile's first event.
        memory = [e["args"] for e in events if e.get("name") == "[memory]"]
        start = memory[0]["Total Allocated"] - memory[0]["Bytes"] if memory else 0
        peak = max([m["Total Allocated"] for m in memory] + [start]) - start
    return peak / 2**20, statistics.median(times), loss.item()


def inputs(tokens, width, vocab, device):
    torch.manual_seed(0)
    h = torch.randn(tokens, width, device=device).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(vocab, width, device=device) * 0.02).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, vocab, (tokens,), device=device)
    return h, w, y


def check(ways):
    """Each way's loss and gradients against float64's: 0 if all agree."""
    device = torch.device("cpu")
    h, w, y = inputs(192, 64, 500, device)
    h64, w64 = h.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    reference = F.cross_entropy(F.linear(h64, w64), y)
    reference.backward()
    failures = 0
    for way in ways:
        loss_of = way_function(way, device, check=True)
        if isinstance(loss_of, str):
            print(f"{way}: not run: {loss_of}")
            failures += 1
            continue
        loss = run(loss_of, h, w, y, device)
        errors = [abs(loss.item() - reference.item()) / abs(reference.item()),
                  ((h.grad.double() - h64.grad).norm() / h64.grad.norm()).item(),
                  ((w.grad.double() - w64.grad).norm() / w64.grad.norm()).item()]
        # The logits and gradients in bfloat16 (8 bits of mantissa); the mean
        # loss averages the logits' rounding out.
        ok = errors[0] < 1e-3 and errors[1] < 2e-2 and errors[2] < 2e-2
        failures += not ok
        print(f"{way}: relative error vs float64: loss {errors[0]:.2e}, d hidden {errors[1]:.2e}, "
              f"d weight {errors[2]:.2e} {'ok' if ok else 'OFF'}")
    if not failures:
        print(f"loss layer peers agree with float64: {', '.join(ways)}")
    return 1 if failures else 0


def main():
    ways = args.ways.split(",")
    if args.check:
        return check(ways)
    device = torch.device(args.device)
    h, w, y = inputs(args.tokens, args.width, args.vocab, device)
    for way in ways:
        loss_of = way_function(way, device)
        if isinstance(loss_of, str):
            print(f"row {way} not_run {loss_of}", flush=True)
            continue
        if way == "liger" and device.type == "cpu":
            print(f"row {way} not_run Liger's Triton kernels need a GPU (on a CPU only Triton's interpreter runs them: "
                  "--check)", flush=True)
            continue
        peak, ms, loss = measure(loss_of, h, w, y, device, args.repeats)
        print(f"row {way} peak_mib {peak:.1f} ms {ms:.2f} loss {loss:.5f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
