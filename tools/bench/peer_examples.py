# SPDX-License-Identifier: BSD-3-Clause
"""The examples' models and loops in Python with torch.amp: the peer amp is
compared with in BENCHMARKS.md (tools/bench/peer_table.sh runs both).

    python peer_examples.py fashion_mnist fp32|autocast|autocast_scaler [--train_limit N] ...
    python peer_examples.py transformer   fp32|autocast|autocast_scaler [--steps N] ...

The models mirror examples/common/fashion_mnist_net.cpp and
char_transformer.cpp, the loops examples/fashion_mnist.cpp and
transformer_lm.cpp (same optimizers, learning rates, batch sizes, data).
autocast is torch.autocast("cpu", bfloat16); autocast_scaler adds
torch.amp.GradScaler as GradScaler users write it. Prints one line:
"peer <model> <mode>  ms/step X  peak RSS Y MiB  <metric>".
"""
import argparse
import gzip
import math
import os
import resource
import struct
import time

import torch
import torch.nn.functional as F
from torch import nn


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def read_idx(path, magic, dims):
    data = gzip.open(path).read()
    assert struct.unpack(">I", data[:4])[0] == magic, f"{path} is not an idx file"
    shape = struct.unpack(f">{dims}I", data[4:4 + 4 * dims])
    return torch.frombuffer(bytearray(data[4 + 4 * dims:]), dtype=torch.uint8).reshape(shape).clone()


def load_fashion_mnist(directory, train, limit):
    prefix = f"{directory}/{'train' if train else 't10k'}"
    images = read_idx(f"{prefix}-images-idx3-ubyte.gz", 2051, 3)
    labels = read_idx(f"{prefix}-labels-idx1-ubyte.gz", 2049, 1)
    if 0 < limit < images.shape[0]:
        images, labels = images[:limit], labels[:limit]
    images = ((images.float() / 255.0 - 0.2860) / 0.3530).unsqueeze(1).contiguous()
    return images, labels.long()


class FashionNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.bn1 = nn.BatchNorm2d(32)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.bn2 = nn.BatchNorm2d(64)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.bn1(self.conv1(x))), 2)
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, time_, width = x.shape
        split = self.qkv(self.norm1(x)).view(batch, time_, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(split[0], split[1], split[2], is_causal=True)
        h = x + self.proj(attended.transpose(1, 2).reshape(batch, time_, width))
        return h + self.down(F.gelu(self.up(self.norm2(h))))


class CharTransformer(nn.Module):
    def __init__(self, vocab=256, context=64, width=64, heads=4, layers=2):
        super().__init__()
        self.token, self.position = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(width), nn.Linear(width, vocab)

    def forward(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def read_license_corpus(directory):
    paths = sorted(os.path.join(directory, f) for f in os.listdir(directory))
    paths = [p for p in paths if os.path.isfile(p) and not os.path.islink(p)]
    return b"".join(open(p, "rb").read() + b"\n" for p in paths)


def train_step(model, optimizer, scaler, mode, loss_of, clip=None):
    optimizer.zero_grad()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mode != "fp32"):
        loss = loss_of(model)
    if scaler:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(optimizer)
        scaler.update()
    else:
        loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    return loss


def fashion_mnist(args):
    train_x, train_y = load_fashion_mnist(args.data_dir, True, args.train_limit)
    test_x, test_y = load_fashion_mnist(args.data_dir, False, args.test_limit)
    torch.manual_seed(0)
    model = FashionNet()
    optimizer = torch.optim.Adam(model.parameters(), lr=2e-3)
    scaler = torch.amp.GradScaler("cpu") if args.mode == "autocast_scaler" else None
    steps, start = 0, time.perf_counter()
    order = torch.randperm(train_x.shape[0])
    for first in range(0, train_x.shape[0], args.batch_size):
        index = order[first:first + args.batch_size]
        x, y = train_x[index], train_y[index]
        train_step(model, optimizer, scaler, args.mode, lambda m: F.cross_entropy(m(x), y))
        steps += 1
    seconds = time.perf_counter() - start
    model.eval()
    correct = 0
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mode != "fp32"):
        for first in range(0, test_x.shape[0], 512):
            correct += (model(test_x[first:first + 512]).argmax(1) == test_y[first:first + 512]).sum().item()
    accuracy = 100.0 * correct / test_x.shape[0]
    print(f"peer fashion_mnist {args.mode}  ms/step {1000 * seconds / steps:.1f}  "
          f"peak RSS {peak_rss_mib():.0f} MiB  test accuracy {accuracy:.2f}%")


def transformer(args):
    corpus = torch.tensor(list(read_license_corpus(args.corpus_dir)), dtype=torch.long)
    torch.manual_seed(0)
    model = CharTransformer(context=args.context)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scaler = torch.amp.GradScaler("cpu") if args.mode == "autocast_scaler" else None
    offsets = torch.arange(args.context + 1)
    start, loss = time.perf_counter(), None
    for _ in range(args.steps):
        starts = torch.randint(0, corpus.shape[0] - args.context - 1, (args.batch_size,))
        windows = corpus[starts.unsqueeze(1) + offsets]
        inputs, targets = windows[:, :-1], windows[:, 1:]
        loss = train_step(model, optimizer, scaler, args.mode,
                          lambda m: F.cross_entropy(m(inputs).reshape(-1, 256), targets.reshape(-1)), clip=1.0)
    seconds = time.perf_counter() - start
    print(f"peer transformer {args.mode}  ms/step {1000 * seconds / args.steps:.1f}  "
          f"peak RSS {peak_rss_mib():.0f} MiB  final loss {loss.item():.3f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=["fashion_mnist", "transformer"])
    parser.add_argument("mode", choices=["fp32", "autocast", "autocast_scaler"])
    parser.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist")
    parser.add_argument("--train_limit", type=int, default=20000)
    parser.add_argument("--test_limit", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=None)
    parser.add_argument("--corpus_dir", default="/usr/share/common-licenses")
    parser.add_argument("--steps", type=int, default=500)
    parser.add_argument("--context", type=int, default=64)
    args = parser.parse_args()
    if args.batch_size is None:
        args.batch_size = 128 if args.model == "fashion_mnist" else 32
    (fashion_mnist if args.model == "fashion_mnist" else transformer)(args)


if __name__ == "__main__":
    main()
