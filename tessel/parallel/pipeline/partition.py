"""Cut the reference GPT into pipeline stages that keep the full model's parameter names.

Stage s of S = p * v holds a contiguous run of blocks; the first also holds the
token embedding, the last the final norm and the output head (the loss is
computed beside it). Blocks sit in an nn.ModuleDict keyed by their index in the
full model, so a stage's parameters are named exactly as in the whole model
(`layers.3.attn.wq.weight`): a checkpoint written under one layout loads under
another.

How many blocks each stage gets: a user layout (`parallel.pp_layout`), or a
balance of per-block costs (parameter count or measured time) in which the
embedding's cost is added to the first stage and the head's to the last.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.nn as nn

from tessel.models.gpt import GPT, cross_entropy


class PipelineStage(nn.Module):
    """A contiguous slice of a GPT: (B, T) ids or (B, T, C) activations -> (B, T, C) or logits."""

    def __init__(self, model: GPT, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        self.layer_ids = list(range(first, last))
        if is_first:
            self.tok_emb = model.tok_emb
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in self.layer_ids})
        if is_last:
            self.norm = model.norm
            self.lm_head = model.lm_head  # with tied embeddings: the same tensor as tok_emb.weight
        self.register_buffer("rope_cos", model.rope_cos, persistent=False)
        self.register_buffer("rope_sin", model.rope_sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:
            x = self.tok_emb(x)  # (B, T) -> (B, T, C)
        for layer in self.layers.values():
            x = layer(x, self.rope_cos, self.rope_sin)
        if self.is_last:
            x = self.lm_head(self.norm(x))  # (B, T, V)
        return x


def balanced_layout(costs: Sequence[float], stages: int, head: float = 0.0, tail: float = 0.0) -> list[int]:
    """Blocks per stage for contiguous stages minimising the costliest one.

    costs[i] is block i's cost; `head` is added to the first stage (embedding)
    and `tail` to the last (norm, output head, loss). Exact dynamic programme,
    O(stages * n^2), trivial for any real depth. Ties prefer earlier cuts.
    """
    n = len(costs)
    if not 1 <= stages <= n:
        raise ValueError(f"cannot cut {n} blocks into {stages} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, i: int, j: int) -> float:  # stage s holds blocks i..j-1
        return prefix[j] - prefix[i] + (head if s == 0 else 0.0) + (tail if s == stages - 1 else 0.0)

    inf = float("inf")
    # best[s][j]: the smallest max stage cost when stages 0..s hold blocks 0..j-1
    best = [[inf] * (n + 1) for _ in range(stages)]
    cut = [[0] * (n + 1) for _ in range(stages)]
    for j in range(1, n + 1):
        best[0][j] = cost(0, 0, j)
    for s in range(1, stages):
        for j in range(s + 1, n + 1):
            for i in range(s, j):
                c = max(best[s - 1][i], cost(s, i, j))
                if c < best[s][j] - 1e-12:
                    best[s][j], cut[s][j] = c, i
    layout, j = [], n
    for s in reversed(range(stages)):
        i = cut[s][j] if s else 0
        layout.append(j - i)
        j = i
    return layout[::-1]


def uniform_layout(n_layer: int, stages: int) -> list[int]:
    """Equal blocks per stage; the remainder goes to the middle stages, leaning to the front
    (the ends carry embedding and head; the head and loss cost more than the lookup)."""
    base, extra = divmod(n_layer, stages)
    layout = [base] * stages
    start = (stages - extra) // 2
    for s in range(start, start + extra):
        layout[s] += 1
    return layout


def param_costs(model: GPT) -> tuple[list[float], float, float]:
    blocks = [float(sum(p.numel() for p in layer.parameters())) for layer in model.layers]
    head = float(model.tok_emb.weight.numel())
    tail = float(sum(p.numel() for p in model.norm.parameters()) + model.lm_head.weight.numel())
    return blocks, head, tail


@torch.enable_grad()
def time_costs(model: GPT, batch: int, seq_len: int, device: torch.device, repeats: int = 3) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, the embedding, and head+loss (median of repeats)."""
    vocab = model.tok_emb.num_embeddings
    idx = torch.randint(0, vocab, (batch, seq_len), device=device)

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats + 1):  # the first call warms up kernels and allocator
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            samples.append(time.perf_counter() - t0)
        return sorted(samples[1:])[len(samples[1:]) // 2]

    x = model.tok_emb(idx).detach().requires_grad_(True)
    cos, sin = model.rope_cos, model.rope_sin
    blocks = [timed(lambda layer=layer: layer(x, cos, sin).sum().backward()) for layer in model.layers]
    head = timed(lambda: model.tok_emb(idx).sum().backward())
    tail = timed(lambda: cross_entropy(model.lm_head(model.norm(x)), idx).backward())
    model.zero_grad(set_to_none=True)
    return blocks, head, tail


def stage_bounds(layout: Sequence[int]) -> list[tuple[int, int]]:
    bounds, start = [], 0
    for n in layout:
        bounds.append((start, start + n))
        start += n
    return bounds


def split_model(model: GPT, layout: Sequence[int], rank: int, p: int) -> list[PipelineStage]:
    """This pipeline rank's chunks: virtual stages rank, rank + p, rank + 2p, ..."""
    bounds = stage_bounds(layout)
    last = len(layout) - 1
    return [PipelineStage(model, *bounds[s], is_first=s == 0, is_last=s == last)
            for s in range(rank, len(layout), p)]
