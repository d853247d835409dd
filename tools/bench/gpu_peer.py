"""What a Python user runs instead of amp on the GPU: torch.amp (autocast +
GradScaler) with AdamW foreach and AdamW fused, beside FP32 (TF32 off and on), on the
models and sizes of tools/bench/gpu_benchmarks.cpp (ResNet-18 at batch 256 on
3x224x224; the GPT-2-small-shaped transformer, 12 x 768, 12 heads, sequence
1024, batch 8). Prints Markdown tables in gpu_benchmarks' format: the mean
step of one window of steps with one sync at its end (CUDA events) after
warm-up, peak allocated memory, host syncs per step (GradScaler.step reads
found_inf on the host unless the optimizer is fused) and the final loss.

    python3 tools/bench/gpu_peer.py [warmup=10] [timed=50] [models=resnet,gpt]
"""
import os
import sys

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


def resnet_loss(model):
    x = torch.randn(256, 3, 224, 224, device="cuda")
    y = torch.randint(0, 1000, (256,), device="cuda")
    return F.cross_entropy(model(x), y)


GPT = dict(vocab=50257, context=1024, width=768, heads=12, layers=12)


def gpt_loss(model):
    tokens = torch.randint(0, GPT["vocab"], (8, 1025), device="cuda")
    logits = model(tokens[:, :1024])
    return F.cross_entropy(logits.reshape(-1, GPT["vocab"]), tokens[:, 1:].reshape(-1))


def measure(make, loss_of, mode, low, warmup, timed):
    torch.manual_seed(0)
    model = make().cuda()
    fp32 = mode.startswith("fp32")
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "fp32_tf32"
    fused = mode != "foreach"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=not fused, fused=fused)
    scaler = torch.amp.GradScaler("cuda", enabled=not fp32)
    syncs, loss = 0, None

    def step():
        nonlocal syncs, loss
        optimizer.zero_grad()
        with torch.autocast("cuda", dtype=low, enabled=not fp32):
            loss = loss_of(model)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        syncs += 0 if fp32 or fused else 1  # GradScaler.step's found_inf.item()

    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    syncs = 0
    # One window of steps and one sync at its end, as gpu_benchmarks times.
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(timed):
        step()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / timed, torch.cuda.max_memory_allocated() / 2**30, syncs / timed, loss.item()


def main():
    warmup = int(sys.argv[1]) if len(sys.argv) > 1 else 10
    timed = int(sys.argv[2]) if len(sys.argv) > 2 else 50
    models = sys.argv[3] if len(sys.argv) > 3 else "resnet,gpt"
    torch.backends.cudnn.benchmark = True
    workloads = []
    if "resnet" in models:
        workloads.append(("ResNet-18, batch 256, 3x224x224", ResNet18, resnet_loss))
    if "gpt" in models:
        workloads.append(("GPT-2-small shape (12 x 768, 12 heads), seq 1024, batch 8",
                          lambda: CharTransformer(**GPT), gpt_loss))
    print(f"Python torch.amp on {torch.cuda.get_device_name()}, torch {torch.__version__}; "
          f"mean step of one {timed}-step window (one sync at its end) after {warmup} warm-up steps")
    names = {"fp32": "FP32 (TF32 off), AdamW fused", "fp32_tf32": "FP32 (TF32 on), AdamW fused",
             "foreach": "torch.amp, AdamW foreach", "fused": "torch.amp, AdamW fused"}
    for title, make, loss_of in workloads:
        for low in (torch.float16, torch.bfloat16):
            print(f"\n{title}, low precision {low}")
            print("| mode | step ms | speedup vs FP32 | peak GiB | peak / FP32 | host syncs/step | final loss |")
            print("|---|---:|---:|---:|---:|---:|---:|")
            results = {mode: measure(make, loss_of, mode, low, warmup, timed) for mode in names}
            fp32_ms, fp32_peak = results["fp32"][:2]
            for mode, (ms, peak, syncs, loss) in results.items():
                print(f"| {names[mode]} | {ms:.1f} | {fp32_ms / ms:.2f} | {peak:.2f} | {peak / fp32_peak:.2f} "
                      f"| {syncs:.0f} | {loss:.3f} |", flush=True)


if __name__ == "__main__":
    main()
