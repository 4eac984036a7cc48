"""Cut a model into pipeline stages: each is the model with the modules it does not own removed.

Stage s of S = p * v holds a contiguous run of blocks; the first also holds the
token embedding, the last the final norm and the output head (the loss is
computed beside it). A stage is the model itself with the other modules taken
out by name, as torchtitan's pipeline_parallel.py cuts its stages: the model's
own forward runs and skips what is absent (tessel.models.gpt.GPT.forward), so
no stage re-implements it. Removed blocks leave the others under their index
in the full model, so a stage's parameters are named exactly as in the whole
model (`layers.3.attn.wq.weight`): a checkpoint written under one layout loads
under another.

How many blocks each stage gets: a user layout (`parallel.pp_layout`), or a
balance of per-block costs (parameter count or measured time) in which the
embedding's cost is added to the first stage and the head's to the last.
"""

from __future__ import annotations

import copy
import itertools
import time
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from tessel.models.gpt import GPT, cross_entropy


@dataclass(frozen=True)
class ModelParts:
    """Where a model keeps what a pipeline cuts, by module name: data, as the TP plan is.

    `before` runs ahead of the blocks (on the first stage), `after` behind them
    (on the last); `blocks` is the list of blocks; `tied` names the input
    embedding's and the output head's weight, one tensor when they are tied.
    """
    before: tuple[str, ...] = ("tok_emb",)
    blocks: str = "layers"
    after: tuple[str, ...] = ("norm", "lm_head")
    tied: tuple[str, str] = ("tok_emb.weight", "lm_head.weight")


GPT_PARTS = ModelParts()


def removed_modules(parts: ModelParts, n_blocks: int, stage: tuple[int, int], first: bool, last: bool) -> list[str]:
    """Names of the modules a stage holding blocks stage[0]..stage[1]-1 does not own."""
    names = [] if first else list(parts.before)
    names += [f"{parts.blocks}.{i}" for i in range(n_blocks) if not stage[0] <= i < stage[1]]
    return names + ([] if last else list(parts.after))


def without_modules(model: nn.Module, names: Sequence[str]) -> nn.Module:
    """The model with the modules `names` removed; everything it keeps is the model's own object.

    Only the modules above a removed one (the root, the block list) are copied,
    so the model itself stays whole; deepcopy's memo maps every other module,
    parameter and buffer to itself. A removed entry of a container (ModuleList,
    ModuleDict, Sequential) is deleted: its siblings keep their names and the
    container iterates over what is left. Any other removed module becomes
    None, which the model's forward skips.
    """
    above = {""} | {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    shared = {id(m): m for name, m in model.named_modules(remove_duplicate=False) if name not in above}
    shared |= {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    stage = copy.deepcopy(model, shared)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = stage.get_submodule(parent_name)
        if isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            delattr(parent, leaf)
        else:
            setattr(parent, leaf, None)
    return stage


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


def split_model(model: nn.Module, layout: Sequence[int], rank: int, p: int,
                parts: ModelParts = GPT_PARTS) -> list[nn.Module]:
    """This pipeline rank's chunks: virtual stages rank, rank + p, rank + 2p, ... (Narayanan et al. 2021)."""
    bounds = stage_bounds(layout)
    last = len(layout) - 1
    return [without_modules(model, removed_modules(parts, sum(layout), bounds[s], s == 0, s == last))
            for s in range(rank, len(layout), p)]
