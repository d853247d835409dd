# SPDX-License-Identifier: BSD-3-Clause
"""Peer for amp's loss scaling: PyTorch's own torch.amp (autocast + GradScaler).

Trains the two-layer model of tests/grad_scaler_peer_test.cpp on the data the
test wrote, with the same injected inf/NaN gradients, and writes what the
test compares bit for bit: the loss scale and skip decision after every step
and the final parameters.

    python grad_scaler_peer.py DIR OPTIMIZERS STEPS INIT_SCALE GROWTH_INTERVAL FAULTS

OPTIMIZERS is a comma-separated list of sgd, adam, sgd_fused, adam_fused,
adamw_fused, each trained from the same start (one process: torch's import
is most of a run). FAULTS is "step:inf,step:nan,..." ("-" for none). DIR
holds the raw float32 files the test wrote (w1 b1 w2 b2 x t); results go to
DIR/peer_*_<optimizer>.
"""
import math
import struct
import sys

import torch


def read(directory, name, shape):
    with open(f"{directory}/{name}", "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.float32).reshape(shape).clone()


def write(directory, name, tensor):
    values = tensor.detach().to(torch.float32).flatten().tolist()  # float32 values, exact as doubles
    with open(f"{directory}/{name}", "wb") as f:
        f.write(struct.pack(f"<{len(values)}f", *values))


class LibTorchAdam(torch.optim.Optimizer):
    """LibTorch's C++ Adam, op for op (torch/csrc/api/src/optim/adam.cpp).

    Python's Adam uses lerp for the first moment, which rounds differently;
    the peer under test is GradScaler, so the optimizer follows LibTorch.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                state["step"] += 1
                bias_correction1 = 1 - math.pow(beta1, state["step"])
                bias_correction2 = 1 - math.pow(beta2, state["step"])
                state["exp_avg"].mul_(beta1).add_(p.grad, alpha=1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(group["eps"])
                p.addcdiv_(state["exp_avg"], denom, value=-group["lr"] / bias_correction1)


def train(directory, optimizer_name, steps, init_scale, growth_interval, plan):
    w1 = read(directory, "w1", (16, 8)).requires_grad_()
    b1 = read(directory, "b1", (16,)).requires_grad_()
    w2 = read(directory, "w2", (4, 16)).requires_grad_()
    b2 = read(directory, "b2", (4,)).requires_grad_()
    x = read(directory, "x", (steps, 32, 8))
    t = read(directory, "t", (steps, 32, 4))
    params = [w1, b1, w2, b2]
    # "_fused": torch.amp's zero-sync path, the optimizer's fused kernel taking
    # GradScaler's scale and overflow flag.
    if optimizer_name == "sgd":
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9)
    elif optimizer_name == "sgd_fused":
        optimizer = torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)
    elif optimizer_name == "adam_fused":
        optimizer = torch.optim.Adam(params, lr=1e-2, fused=True)
    elif optimizer_name == "adamw_fused":
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.05, amsgrad=True, fused=True)
    else:
        optimizer = LibTorchAdam(params, lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale, growth_interval=growth_interval)
    scales, skipped = [], []
    for step in range(steps):
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            hidden = torch.relu(torch.nn.functional.linear(x[step], w1, b1))
            y = torch.nn.functional.linear(hidden, w2, b2)
            loss = (y.float() - t[step]).pow(2).mean()
        scaler.scale(loss).backward()
        if step in plan:
            w1.grad[0, 0] = plan[step]
        scaler.step(optimizer)
        found_inf = sum(v.item() for v in scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values())
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(1.0 if found_inf else 0.0)
    write(directory, f"peer_scales_{optimizer_name}", torch.tensor(scales))
    write(directory, f"peer_skipped_{optimizer_name}", torch.tensor(skipped))
    write(directory, f"peer_params_{optimizer_name}", torch.cat([p.detach().flatten() for p in params]))


def main():
    directory, optimizers, steps, init_scale, growth_interval, faults = sys.argv[1:7]
    steps, init_scale, growth_interval = int(steps), float(init_scale), int(growth_interval)
    plan = {}
    if faults != "-":
        for item in faults.split(","):
            step, kind = item.split(":")
            plan[int(step)] = float(kind)
    torch.set_num_threads(1)
    for optimizer_name in optimizers.split(","):
        train(directory, optimizer_name, steps, init_scale, growth_interval, plan)


if __name__ == "__main__":
    main()
