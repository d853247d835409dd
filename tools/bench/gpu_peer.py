# SPDX-License-Identifier: BSD-3-Clause
"""What a Python user runs instead of amp on the GPU, on the models and sizes
of tools/bench/gpu_benchmarks.cpp (ResNet-18 at batch 256 on 3x224x224; the
GPT-2-small-shaped transformer, 12 x 768, 12 heads, sequence 1024, batch 8,
with gpu_benchmarks' vocabulary of 50304 - GPT-2's 50257 padded to a
multiple of 64 - and once with 50257 beside it): FP32 (TF32 off and on),
torch.amp (autocast + GradScaler) with AdamW foreach and fused,
torch.compile(model) with torch.amp and fused AdamW (and with
mode="reduce-overhead", CUDA graphs, on GPT), and for bfloat16 torchao's
float8 training (convert_to_float8_training) with torch.compile; the
small-batch step and the four Transformer Engine quickstart layers of
gpu_benchmarks (small_batch, te_layers); and one Linear layer's step at
gpu_benchmarks' sweep of shapes (8192 tokens, 768 x 3072 to 8192 x 28672)
in bfloat16, eager and with torchao's float8.

Prints Markdown tables in gpu_benchmarks' format: the mean step of one window
of steps with one sync at its end (CUDA events) after warm-up, peak allocated
memory, host syncs per step - counted, not assumed: CUDA's sync debug mode
warns at every synchronizing call in the window, and the warnings are
counted, as gpu_benchmarks counts amp's and LibTorch's - and the final loss.

    python3 tools/bench/gpu_peer.py [warmup=10] [timed=50] [models=resnet,gpt,small_batch,te_layers,sweep]
    python3 tools/bench/gpu_peer.py --smoke   # no GPU: every mode, tiny, on the CPU

--smoke runs each mode for one step of a tiny transformer on the CPU (bfloat16
only), to show the script and its peers (torch.compile, torchao) work where
no GPU is; its numbers are not figures. There torch.compile traces the models
with Dynamo and runs the graphs eagerly (backend "eager"): code generation is
the GPU's (Triton), and Inductor's C++ build on the CPU took a minute.
"""
import os
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_examples import CharTransformer  # noqa: E402  (the C++ examples' model)


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(y + (self.down(x) if self.down is not None else x))


class ResNet18(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 64, 7, 2, 3, bias=False)
        self.bn = nn.BatchNorm2d(64)
        blocks, cin = [], 64
        for width in (64, 128, 256, 512):
            blocks += [BasicBlock(cin, width, 1 if width == 64 else 2), BasicBlock(width, width, 1)]
            cin = width
        self.blocks = nn.Sequential(*blocks)
        self.fc = nn.Linear(512, 1000)

    def forward(self, x):
        h = F.max_pool2d(F.relu(self.bn(self.stem(x))), 3, 2, 1)
        return self.fc(F.adaptive_avg_pool2d(self.blocks(h), 1).flatten(1))


def resnet_loss(device):
    def loss_of(model):
        x = torch.randn(256, 3, 224, 224, device=device)
        y = torch.randint(0, 1000, (256,), device=device)
        return F.cross_entropy(model(x), y)
    return loss_of


# gpu_benchmarks' transformer; --smoke's stand-in.
GPT = dict(vocab=50304, context=1024, width=768, heads=12, layers=12, batch=8)
SMOKE_GPT = dict(vocab=96, context=16, width=32, heads=4, layers=2, batch=2)
# gpu_benchmarks' small step and its four Transformer Engine quickstart layers.
SMALL_BATCH = dict(GPT, context=128, batch=1)
TE_LAYERS = dict(vocab=256, context=2048, width=4096, heads=32, layers=4, batch=4)


def gpt(shape):
    model = dict((k, v) for k, v in shape.items() if k != "batch")
    return lambda: CharTransformer(**model)


# gpu_benchmarks' fp8_sweep_table: (in, out) at 8192 tokens.
SWEEP = [(768, 3072), (1024, 4096), (2048, 8192), (4096, 16384), (16384, 4096), (8192, 28672)]


def linear_loss(tokens, features, device):
    x = torch.randn(tokens, features, device=device)
    return lambda model: model(x).float().mean()


def gpt_loss(shape, device):
    vocab, context, batch = shape["vocab"], shape["context"], shape["batch"]

    def loss_of(model):
        tokens = torch.randint(0, vocab, (batch, context + 1), device=device)
        logits = model(tokens[:, :context])
        return F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
    return loss_of


# mode: (label, compiled, float8)
MODES = {
    "fp32": ("FP32 (TF32 off), AdamW fused", False, False),
    "fp32_tf32": ("FP32 (TF32 on), AdamW fused", False, False),
    "foreach": ("torch.amp, AdamW foreach", False, False),
    "fused": ("torch.amp, AdamW fused", False, False),
    "compiled": ("torch.compile + torch.amp, AdamW fused", True, False),
    "compiled_graphs": ('torch.compile(mode="reduce-overhead") + torch.amp, AdamW fused', "reduce-overhead", False),
    "float8": ("torchao float8 + torch.compile + torch.amp, AdamW fused", True, True),
}


def counting_syncs(device, run):
    """Runs `run` with CUDA's sync debug mode warning at each synchronizing
    call; returns the number of warnings (0 off CUDA)."""
    if device.type != "cuda":
        run()
        return 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def measure(make, loss_of, mode, low, device, warmup, timed):
    torch.manual_seed(0)
    model = make().to(device)
    _, compiled, float8 = MODES[mode]
    if float8:
        from torchao.float8 import convert_to_float8_training
        convert_to_float8_training(model)
    forward = model
    if compiled:
        backend = "eager" if device.type == "cpu" else "inductor"  # --smoke: see the docstring
        forward = (torch.compile(model, mode=compiled, backend=backend) if isinstance(compiled, str)
                   else torch.compile(model, backend=backend))
    fp32 = mode.startswith("fp32")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "fp32_tf32"
    fused = mode != "foreach"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=not fused, fused=fused)
    scaler = torch.amp.GradScaler(device.type, enabled=not fp32)
    loss = None

    def step():
        nonlocal loss
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=low, enabled=not fp32):
            loss = loss_of(forward)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        # One window of steps and one sync at its end, as gpu_benchmarks times.
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        syncs = counting_syncs(device, lambda: [step() for _ in range(timed)])
        stop.record()
        stop.synchronize()
        ms, peak = start.elapsed_time(stop) / timed, torch.cuda.max_memory_allocated() / 2**30
    else:
        begin = time.perf_counter()
        syncs = counting_syncs(device, lambda: [step() for _ in range(timed)])
        ms, peak = (time.perf_counter() - begin) * 1000 / timed, float("nan")
    return ms, peak, syncs / timed, loss.item()


def main():
    smoke = "--smoke" in sys.argv or not torch.cuda.is_available()
    args = [a for a in sys.argv[1:] if a != "--smoke"]
    warmup = int(args[0]) if len(args) > 0 else (1 if smoke else 10)
    timed = int(args[1]) if len(args) > 1 else (1 if smoke else 50)
    models = (args[2] if len(args) > 2 else "gpt,sweep" if smoke else "resnet,gpt,small_batch,te_layers,sweep").split(",")
    device = torch.device("cpu" if smoke else "cuda")
    shape = SMOKE_GPT if smoke else GPT
    unpadded = dict(shape, vocab=80 if smoke else 50257)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    try:
        import torchao  # noqa: F401
        torchao_missing = None
    except ImportError as e:
        torchao_missing = str(e)
    lows = [torch.bfloat16] if smoke else [torch.float16, torch.bfloat16]
    # (title, make, loss, low dtypes, modes)
    workloads = []
    if "gpt" in models:
        title = (f"GPT-2-small shape ({shape['layers']} x {shape['width']}, {shape['heads']} heads), "
                 f"seq {shape['context']}, batch {shape['batch']}, vocabulary {shape['vocab']}")
        # (CUDA graphs need a GPU: --smoke leaves reduce-overhead out.)
        modes = [m for m in MODES if not (smoke and m == "compiled_graphs")]
        workloads.append((title, gpt(shape), gpt_loss(shape, device), lows, modes))
        workloads.append((f"The same with vocabulary {unpadded['vocab']} (unpadded)", gpt(unpadded),
                          gpt_loss(unpadded, device), lows, ["fused"] if smoke else ["fused", "compiled"]))
    if "small_batch" in models and not smoke:
        workloads.append(("GPT-2-small shape, seq 128, batch 1 (a small step)", gpt(SMALL_BATCH),
                          gpt_loss(SMALL_BATCH, device), [torch.bfloat16], ["fused", "compiled", "compiled_graphs"]))
    if "te_layers" in models and not smoke:
        workloads.append(("Transformer Engine's quickstart layer x 4 (4096, FFN 16384, 32 heads), seq 2048, batch 4",
                          gpt(TE_LAYERS), gpt_loss(TE_LAYERS, device), [torch.bfloat16],
                          ["fp32_tf32", "fused", "compiled", "float8"]))
    if "resnet" in models:
        workloads.append(("ResNet-18, batch 256, 3x224x224", ResNet18, resnet_loss(device), lows,
                          ["fp32", "fp32_tf32", "foreach", "fused", "compiled"]))
    if "sweep" in models:
        tokens = 32 if smoke else 8192
        for features, out in SWEEP[:1] if smoke else SWEEP:
            if smoke:
                features, out = 32, 64
            workloads.append((f"One Linear {features} x {out}, {tokens} tokens",
                              lambda f=features, o=out: nn.Linear(f, o), linear_loss(tokens, features, device),
                              [torch.bfloat16], ["fp32", "fused", "float8"]))
    where = "the CPU (--smoke: checks the code; not figures)" if smoke else torch.cuda.get_device_name()
    print(f"Python peers on {where}, torch {torch.__version__}; mean step of one {timed}-step window "
          f"(one sync at its end) after {warmup} warm-up steps; host syncs counted by CUDA's sync debug mode")
    for title, make, loss_of, low_dtypes, modes in workloads:
        for low in low_dtypes:
            print(f"\n{title}, low precision {low}")
            print("| mode | step ms | speedup vs FP32 | peak GiB | peak / FP32 | host syncs/step | final loss |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            reference = None
            for mode in modes:
                label = MODES[mode][0]
                if MODES[mode][2] and low != torch.bfloat16:
                    continue  # float8 training computes around bfloat16
                if MODES[mode][2] and torchao_missing:
                    print(f"| {label} | not run: torchao is not installed ({torchao_missing}) | | | | | |")
                    continue
                try:
                    ms, peak, syncs, loss = measure(make, loss_of, mode, low, device, warmup, timed)
                except RuntimeError as e:
                    # A CPU whose oneDNN has no float8 matmul (one capped by
                    # ONEDNN_MAX_CPU_ISA) refuses torch._scaled_mm: the smoke
                    # got as far as the GEMM; a GPU never takes this path.
                    if not (smoke and MODES[mode][2] and "primitive descriptor" in str(e)):
                        raise
                    print(f"| {label} | not run: this CPU's oneDNN has no float8 matmul | | | | | |")
                    continue
                if reference is None and mode.startswith("fp32"):
                    reference = (ms, peak)
                speed = f"{reference[0] / ms:.2f}" if reference else "-"
                on_gpu = device.type == "cuda"
                ratio = f"{peak / reference[1]:.2f}" if reference and on_gpu else "-"
                peak_gib = f"{peak:.2f}" if on_gpu else "-"
                print(f"| {label} | {ms:.1f} | {speed} | {peak_gib} | {ratio} | {syncs:.1f} | {loss:.3f} |",
                      flush=True)


if __name__ == "__main__":
    main()
