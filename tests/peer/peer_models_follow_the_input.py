# SPDX-License-Identifier: BSD-3-Clause
"""The Python peers' models run on the device their inputs are on. Each runs
on PyTorch's 'meta' device (shapes, no data) under a dispatch mode that
refuses any CPU tensor, so a tensor a forward builds on the default device
fails here as it would beside a model on a GPU."""
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../tools/bench"))
from gpu_peer import ResNet18  # noqa: E402
from peer_examples import CharTransformer, FashionNet  # noqa: E402


class RefuseCpuTensors(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        for t in tree_leaves((args, kwargs, result)):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                raise AssertionError(f"{func} ran with a CPU tensor while the model is elsewhere")
        return result


meta = torch.device("meta")
cases = [
    ("CharTransformer", CharTransformer(context=16), torch.zeros(2, 16, dtype=torch.long, device=meta)),
    ("FashionNet", FashionNet(), torch.zeros(2, 1, 28, 28, device=meta)),
    ("ResNet18", ResNet18(), torch.zeros(2, 3, 64, 64, device=meta)),
]
for name, model, inputs in cases:
    model.to(meta)
    with RefuseCpuTensors():
        output = model(inputs)
    assert output.device == meta, f"{name}: output on {output.device}"
    print(f"{name}: runs on the inputs' device")
