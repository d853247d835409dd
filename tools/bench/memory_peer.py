# SPDX-License-Identifier: BSD-3-Clause
"""The memory benchmark's Python peer (tools/bench/memory_benchmark.cpp).

The same GPT-shaped decoder as examples/common/char_transformer.cpp (byte
tokens, learned positions, pre-norm blocks of causal 4-head attention and a
4x GELU MLP, tied head), the same AdamW step, in Python's torch: float32,
torch.autocast(bfloat16), autocast with torch.utils.checkpoint on every
block, or selectively (checkpoint_gemms: PyTorch's selective activation
checkpointing keeping the GEMMs' outputs, as amp::Keep::gemm_outputs), and
that with torchao's 8-bit AdamW (torchao.optim.AdamW8bit:
blockwise 8-bit moments; `pip install torchao` into the same Python).
With --vocab larger than 256 the tokens are byte pairs folded into that
many ids (examples::corpus_tokens), and --loss=chunked computes the output
layer and its loss torchtune's way (CEWithChunkedOutputLoss): the hidden
states in 8 chunks along the sequence, each chunk's logits upcast to float32
for its cross-entropy on its own. Bytes are LibTorch's CPU allocator's, as amp counts them: the tensors
held before the step, plus the most the profiler's memory events
(profile_memory=True) see allocated at once during it.

  python memory_peer.py --mode=checkpoint --layers=4
  python memory_peer.py --mode=fp32 --layers=12 --train_steps=20

Prints one line: "peer <mode> layers L parameters P peak_mib X above_start_mib A ms_step Y loss Z".
"""
import argparse
import contextlib
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from peer_examples import Block, read_license_corpus  # the transformer peer's block, the same corpus


class Gpt(torch.nn.Module):
    def __init__(self, layers, width, context, heads=4, vocab=256, recompute=None):
        super().__init__()
        self.token = torch.nn.Embedding(vocab, width)
        self.position = torch.nn.Embedding(context, width)
        self.blocks = torch.nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(width)
        self.recompute = recompute
        torch.nn.init.normal_(self.token.weight, 0.0, 0.02)  # a tied head's weights, as GPT-2's

    def hidden(self, tokens):
        x = self.token(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            if self.recompute == "gemms":
                x = checkpoint(block, x, use_reentrant=False, context_fn=keep_gemm_outputs)
            elif self.recompute == "whole":
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.norm(x)

    def forward(self, tokens):
        return F.linear(self.hidden(tokens), self.token.weight)


GEMMS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.convolution.default}


def keep_gemm_outputs():
    """Selective activation checkpointing's contexts: the GEMMs' outputs saved, the rest recomputed."""
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if op in GEMMS else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def corpus_tokens(vocab, directory="/usr/share/common-licenses"):
    """Bytes, or for a larger vocabulary byte pairs folded into `vocab` ids (as examples::corpus_tokens)."""
    b = torch.tensor(list(read_license_corpus(directory)), dtype=torch.long)
    if vocab == 256:
        return b
    pairs = b.numel() // 2
    return (b[0 : 2 * pairs : 2] * 256 + b[1 : 2 * pairs : 2]).remainder(vocab)


def chunked_loss(model, inputs, targets, vocab, chunks=8):
    """torchtune's CEWithChunkedOutputLoss: each chunk's logits upcast on their own."""
    hidden = model.hidden(inputs)
    total = sum(F.cross_entropy(F.linear(h, model.token.weight).float().reshape(-1, vocab), t.reshape(-1),
                                reduction="sum")
                for h, t in zip(hidden.chunk(chunks, dim=1), targets.chunk(chunks, dim=1)))
    return total / targets.numel()


def batch_for(corpus, step, batch, context):
    torch.manual_seed(1000 + step)
    starts = torch.randint(0, corpus.numel() - context - 1, (batch,))
    windows = corpus[starts.unsqueeze(1) + torch.arange(context + 1)]
    return windows[:, :-1], windows[:, 1:]


def plain_tensors(t):
    """The tensors holding `t`'s bytes: a tensor subclass's inner ones (torchao's 8-bit state)."""
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return [inner for name in names for inner in plain_tensors(getattr(t, name))]
    return [t]


def tensor_bytes(model, optimizer):
    seen, total = set(), 0
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    for state in optimizer.state.values():
        tensors += [inner for t in state.values() if torch.is_tensor(t) for inner in plain_tensors(t)]
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += t.untyped_storage().nbytes()
    return total


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--mode", choices=["fp32", "autocast", "checkpoint", "checkpoint_gemms", "checkpoint8bit"],
                        required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--loss", choices=["plain", "chunked"], default="plain")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--attention", choices=["fused", "math"], default="fused",
                        help="math: attention as its ops (PyTorch's math backend), its scores kept for backward")
    parser.add_argument("--timed_steps", type=int, default=3)
    parser.add_argument("--train_steps", type=int, default=0, help="train this many steps and report the loss")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    corpus = corpus_tokens(args.vocab)
    torch.manual_seed(0)
    model = Gpt(args.layers, args.width, args.context, heads=args.heads, vocab=args.vocab,
                recompute="gemms" if args.mode == "checkpoint_gemms" else
                "whole" if args.mode.startswith("checkpoint") else None)
    if args.mode == "checkpoint8bit":
        from torchao.optim import AdamW8bit
        optimizer = AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.01)  # torch.optim.AdamW's default decay
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(number):
        # The whole step under the backend: checkpoint's rerun in backward
        # picks its attention kernel again.
        with sdpa_kernel(SDPBackend.MATH) if args.attention == "math" else contextlib.nullcontext():
            return attended_step(number)

    def attended_step(number):
        inputs, targets = batch_for(corpus, number, args.batch, args.context)
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.mode != "fp32"):
            if args.loss == "chunked":
                loss = chunked_loss(model, inputs, targets, args.vocab)
            else:
                logits = model(inputs)
        if args.loss == "plain":
            loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        return loss.item()

    step(0)  # creates the optimizer's state
    optimizer.zero_grad()
    held = tensor_bytes(model, optimizer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(1)
    path = tempfile.mktemp(suffix=".json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.remove(path)
    above_start = max([e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"] + [0])
    peak = held + above_start
    times = [0.0]
    for i in range(args.timed_steps):
        start = time.perf_counter()
        step(2 + i)
        times.append(1000 * (time.perf_counter() - start))
    losses = [step(10 + i) for i in range(args.train_steps)]
    loss = statistics.mean(losses[-5:]) if losses else float("nan")
    parameters = sum(p.numel() for p in model.parameters())
    print(f"peer {args.mode}-{args.loss} layers {args.layers} parameters {parameters} peak_mib {peak / 1048576:.2f} "
          f"above_start_mib {above_start / 1048576:.2f} "
          f"ms_step {statistics.median(times[1:] or times):.1f} loss {loss:.4f}")


if __name__ == "__main__":
    main()
