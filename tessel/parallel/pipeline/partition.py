"""Cut a model into pipeline stages: each is the model with the modules it does not own removed.

Stage s of S = p * v holds a contiguous run of blocks; the first also holds the
token embedding, the last the final norm and the output head (the loss is
computed beside it). A stage is the model itself with the other modules taken
out by name, as torchtitan's pipeline_parallel.py cuts its stages: the model's
own forward runs and skips what is absent (tessel.models.gpt.GPT.forward), so
no stage re-implements it. Removed blocks leave the others under their index
in the full model, so a stage's parameters are named exactly as in the whole
model (`layers.3.attn.wq.weight`): a checkpoint written under one layout loads
under another. Where a model's forward does not skip what is absent (a Hugging
Face causal LM), its ModelParts (tessel.models.parts) name what stands in for a
removed module and the keyword a later stage takes its hidden states by; no
forward is copied and nothing is traced.

How many blocks each stage gets: a user layout (`parallel.pp_layout`), or a
balance of per-block costs (parameter count or measured time) in which the
embedding's cost is added to the first stage and the head's to the last.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from tessel.models.gpt import GPT, cross_entropy
from tessel.models.parts import GPT_PARTS, ModelParts, PassesHidden
from tessel.observe.metrics import synced_seconds
from tessel.parallel.pipeline.handover import HandOver
from tessel.parallel.pipeline.schedules import stage_of


def removed_modules(parts: ModelParts, n_blocks: int, stage: tuple[int, int], first: bool, last: bool) -> list[str]:
    """Names of the modules a stage holding blocks stage[0]..stage[1]-1 does not own."""
    names = [] if first else list(parts.before)
    names += [f"{parts.blocks}.{i}" for i in range(n_blocks) if not stage[0] <= i < stage[1]]
    return names + ([] if last else list(parts.after))


def without_modules(model: nn.Module, names: Sequence[str], parts: ModelParts = GPT_PARTS) -> nn.Module:
    """The model with the modules `names` removed; everything it keeps is the model's own object.

    Only the modules above a removed one (the root, the block list) are copied,
    so the model itself stays whole; deepcopy's memo maps every other module,
    parameter and buffer to itself. A removed entry of a container (ModuleList,
    ModuleDict, Sequential) is deleted: its siblings keep their names and the
    container iterates over what is left (parts that hand over at the blocks keep a
    removed block's place with a pass-through, PassesHidden). Any other removed
    module becomes its stand-in in `parts` (a pass-through, a zero), or None,
    which the model's forward skips.
    """
    above = {""} | {".".join(n.split(".")[:i]) for n in names for i in range(1, n.count(".") + 1)}
    shared = {id(m): m for name, m in model.named_modules(remove_duplicate=False) if name not in above}
    shared |= {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
    stage = copy.deepcopy(model, shared)
    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = stage.get_submodule(parent_name)
        if parts.hand_over_at_blocks and parent_name == parts.blocks:
            setattr(parent, leaf, PassesHidden())  # under its index: the model may read a layer's by it
        elif isinstance(parent, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
            delattr(parent, leaf)
        else:
            setattr(parent, leaf, parts.stand_in(name))
    return stage


class HiddenStatesAs:
    """A stage's forward pre-hook: the hidden states it is called with go to the model by keyword
    (a Hugging Face model takes them as `inputs_embeds`, in place of its token embedding)."""

    def __init__(self, keyword: str):
        self.keyword = keyword

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        hidden, *rest = args
        return tuple(rest), {**kwargs, self.keyword: hidden}


def check_placed(model: nn.Module, parts: ModelParts) -> None:
    """ValueError naming the first module whose parameters no part of `parts` holds."""
    unplaced = parts.unplaced(model)
    if unplaced:
        more = f" (and {len(unplaced) - 1} more)" if len(unplaced) > 1 else ""
        raise ValueError(f"pipeline parallelism cannot place {unplaced[0]}{more}: it is in none of the parts a "
                         f"stage is cut by (before the blocks {list(parts.before)}, the blocks '{parts.blocks}', "
                         f"after them {list(parts.after)})")


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


def param_costs(model: nn.Module, parts: ModelParts = GPT_PARTS) -> tuple[list[float], float, float]:
    """Parameters of each block, of the modules before the blocks and after them (a tied head counts
    on the last stage too: it does its matmul there)."""
    def numel(*names: str) -> float:
        return float(sum(p.numel() for n in names for p in model.get_submodule(n).parameters()))

    blocks = [numel(f"{parts.blocks}.{name}") for name, _ in model.get_submodule(parts.blocks).named_children()]
    return blocks, numel(*parts.before), numel(*parts.after)


@torch.enable_grad()
def time_costs(model: GPT, batch: int, seq_len: int, device: torch.device, repeats: int = 3) -> tuple[list[float], float, float]:
    """Measured forward+backward seconds of each block, the embedding, and head+loss (median of repeats)."""
    vocab = model.tok_emb.num_embeddings
    idx = torch.randint(0, vocab, (batch, seq_len), device=device)

    def timed(fn) -> float:
        # the first call warms up kernels and allocator
        samples = [synced_seconds(fn, device) for _ in range(repeats + 1)][1:]
        return sorted(samples)[len(samples) // 2]

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
                parts: ModelParts = GPT_PARTS, vshape: bool = False, sequence_shards: int = 1) -> list[nn.Module]:
    """This pipeline rank's chunks: virtual stages rank, rank + p, rank + 2p, ... (Narayanan et al. 2021),
    or in a V (ZBV, Qi et al. 2023) stages rank and 2p - 1 - rank. sequence_shards: the pieces of the
    sequence that stages exchange (tp under sequence parallelism), for parts that hand over at the blocks."""
    check_placed(model, parts)
    bounds = stage_bounds(layout)
    last = len(layout) - 1
    chunks = []
    for s in (stage_of(p, rank, c, vshape) for c in range(len(layout) // p)):
        chunk = without_modules(model, removed_modules(parts, sum(layout), bounds[s], s == 0, s == last), parts)
        if s > 0 and parts.hidden_input is not None:
            chunk.register_forward_pre_hook(HiddenStatesAs(parts.hidden_input), with_kwargs=True)
        if parts.hand_over_at_blocks:
            HandOver(parts.hidden_input, sequence_shards).attach(chunk, parts.held_blocks(chunk), s == 0, s == last)
        chunks.append(chunk)
    return chunks
