"""Apply a 2D / 2.5D / 3D tensor-parallel mode to the reference GPT or a Hugging Face family, from the same plan
as 1D.

The TP plan (tessel.models.plan's for the reference GPT; for a Hugging Face family the one tessel.models.hf.tp_plan
derives from transformers' base_model_tp_plan; module name -> Megatron style) says what each module is; here
each style maps to its grid layer instead: a column- or row-parallel linear becomes the mode's linear (both
sides of a matmul are split on the grid, so the two kinds coincide), the vocab embedding and head the mode's, a
norm the mode's RMSNorm where it computes one; a head tied to the embedding multiplies by the embedding's own
table. What no grid layer replaces (a norm of another kind, a region whose projections the plan gathers, per-head
norms, an MoE block) runs as the module itself on the hidden dim made whole (tessel.parallel.tensor_nd.whole).
Attention and the MLP need no change: the heads and the feed-forward split over the grid's side, and the models
read head counts from tensor shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from tessel.config import ParallelConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.parallel.plan import Plan
from tessel.parallel.tensor.regions import refuse_own_loss
from tessel.parallel.tensor.tensor_parallel import match_plan
from tessel.parallel.tensor import comm
from tessel.parallel.tensor_nd.cube import (MIXED, STREAM, Cube, Embedding3D, FullLogits3D, Linear3D, Loss3D, RMSNorm3D,
                                            TiedHead3D)
from tessel.parallel.tensor_nd.grid import Grid, build_grid, describe_grid
from tessel.parallel.tensor_nd.summa import (Embedding2D, FullLogits2D, Linear2D, Loss2D, RMSNorm2D, Summa,
                                             TiedHead2D)
from tessel.parallel.tensor_nd.whole import (HiddenSplit, block_whole, computes_rms_norm, gather_output, norm_whole,
                                             split_input, sum_grads)

GRID_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "2d": lambda tp, depth: (round(tp ** 0.5),) * 2,
    "2.5d": lambda tp, depth: (depth, *(round((tp // depth) ** 0.5),) * 2),
    "3d": lambda tp, depth: (round(tp ** (1 / 3)),) * 3,
}


@dataclass
class GridModel:
    """What a grid mode hands apply_tensor_grid: the model, its loss, logits for sampling, and the vocab gather a
    pipeline's last stage samples through."""
    model: nn.Module
    loss_fn: Callable
    full_logits: Callable
    gather_vocab: Callable


class GatherVocab:
    """A grid's logits [batch chunk, :, vocab chunk] -> [batch chunk, :, V] along the group that splits the
    vocabulary (a pipeline's last stage samples from them); collective over that group."""

    def __init__(self, group):
        self.group = group

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return comm.all_gather_dim(logits.contiguous(), -1, self.group)


def grid_shape(mode: str, tp: int, depth: int = 1) -> tuple[int, ...]:
    return GRID_SHAPES[mode](tp, depth)


Layers = dict[str, Callable[[nn.Module], nn.Module]]
# a Hugging Face plan's styles (tessel.models.hf.tp_plan) as the grid reads them: the embedding's output, the
# first layer's input and the final norm's output need nothing on a grid (nothing is replicated to split)
HF_STYLES = {"vocab_embedding_whole": "vocab_embedding", "vocab_head_entered": "vocab_head",
             "final_norm": "sequence_norm", "split_sequence": "enter"}


def norm_eps(norm: nn.Module) -> float:
    """A norm's epsilon: torch's RMSNorm's (None: its dtype's), or a Hugging Face RMSNorm's variance_epsilon."""
    if isinstance(norm, nn.RMSNorm):
        return norm.eps if norm.eps is not None else torch.finfo(norm.weight.dtype).eps
    return float(norm.variance_epsilon)


def activation_shards(mode: str, tp: int, depth: int = 1) -> tuple[int, int]:
    """(batch chunks, hidden chunks) of an activation on the grid: what a pipeline stage sends. (1, 1) in 1D."""
    if mode == "1d" or tp == 1:
        return 1, 1
    side = grid_shape(mode, tp, depth)[-1]
    return {"2d": side, "2.5d": side * depth, "3d": side * side}[mode], side


Mode = tuple[Layers, Callable, Callable, Callable]  # layers by style, the loss, sampling logits, the vocab gather


def _whole_styles(stream: HiddenSplit, mixed: HiddenSplit, grid_norm: Callable[[nn.Module], nn.Module],
                  linear: Callable[[nn.Module], nn.Module]) -> Layers:
    """The styles of a Hugging Face plan that keep a module whole (tessel.parallel.tensor_nd.whole), on a grid
    whose residual stream is split by `stream` and the output of a column layer by `mixed`."""
    def norm(m: nn.Module) -> nn.Module:  # the grid's RMSNorm where the module computes one, else the module whole
        return grid_norm(m) if computes_rms_norm(m) else _done(norm_whole, m, stream)

    def gathered(m: nn.Module) -> nn.Module:  # transformers' colwise_gather_output
        return _done(gather_output, linear(m), mixed)

    def split(m: nn.Module) -> nn.Module:  # rowwise_split_input
        return _done(split_input, linear(m), mixed)

    # a per-head module (q/k norms) applies to this rank's heads of its batch chunk: shares over every grid axis;
    # a module inside a gathered region is the same on every rank of the hidden split: shares over the batch's
    return {"sequence_norm": norm, "colwise_gather": gathered, "rowwise_split": split,
            "sum_grads": lambda m: _done(sum_grads, m, mixed.all_groups),
            "keep": lambda m: _done(sum_grads, m, mixed.batch_groups), "enter": lambda m: m,
            "replicate": lambda m: _done(block_whole, m, stream)}


def _done(hook: Callable, module: nn.Module, *args) -> nn.Module:
    hook(module, *args)
    return module


def _summa_mode(grid: Grid, hidden: int, vocab_size: int, model: nn.Module, overlap: bool = False) -> Mode:
    """2D, and 2.5D (SUMMA in each depth layer). "tied_head" takes the embedding's grid layer. overlap: each
    SUMMA step's broadcasts in flight while the step before multiplies (parallel.tp_overlap)."""
    s = Summa(grid, overlap)
    linear = lambda m: Linear2D(m, s)  # noqa: E731
    split = HiddenSplit(s.row_group, (s.col_group, s.depth_group))  # hidden chunk j; batch chunk (k, i)
    layers = {"colwise": linear, "rowwise": linear, "vocab_head": linear,
              "vocab_embedding": lambda m: Embedding2D(m, s), "tied_head": lambda emb: TiedHead2D(emb, s),
              **_whole_styles(split, split, lambda m: RMSNorm2D(m, s, hidden, norm_eps(m)), linear)}
    return layers, Loss2D(s, vocab_size), FullLogits2D(model, s), GatherVocab(s.row_group)


def _cube_mode(grid: Grid, hidden: int, vocab_size: int, model: nn.Module, overlap: bool = False) -> Mode:
    """3D: layers that read the residual stream take its layout to the mixed one, those that write it back."""
    if overlap:
        raise ValueError("tp_overlap overlaps 1d and 2d, not 3d")
    cube = Cube(grid)
    g = cube.groups
    # a layout L(s, r): hidden chunk on axis r, batch chunk a*c + coord[s] (inner s, outer axis 0)
    stream, mixed = HiddenSplit(g[STREAM[1]], (g[STREAM[0]], g[0])), HiddenSplit(g[MIXED[1]], (g[MIXED[0]], g[0]))
    layers = {"colwise": lambda m: Linear3D(m, cube, STREAM), "vocab_head": lambda m: Linear3D(m, cube, STREAM),
              "rowwise": lambda m: Linear3D(m, cube, MIXED),
              "vocab_embedding": lambda m: Embedding3D(m, cube), "tied_head": lambda emb: TiedHead3D(emb, cube),
              **_whole_styles(stream, mixed, lambda m: RMSNorm3D(m, cube, hidden, norm_eps(m)),
                              lambda m: Linear3D(m, cube, STREAM))}
    layers["rowwise_split"] = lambda m: _done(split_input, Linear3D(m, cube, MIXED), mixed)
    return layers, Loss3D(cube, vocab_size), FullLogits3D(model, cube), GatherVocab(cube.groups[MIXED[1]])


MODES = {"2d": _summa_mode, "2.5d": _summa_mode, "3d": _cube_mode}


def apply_grid_mode(model: nn.Module, plan: dict[str, str], mesh: Mesh, mode: str, depth: int,
                    vocab_size: int, hidden: int, overlap: bool = False) -> GridModel:
    """Swap the plan's modules for the mode's grid layers, in place (collective: builds the grid's groups).
    The plan is the reference GPT's (tessel.models.plan) or a Hugging Face family's (tessel.models.hf.tp_plan).
    overlap: parallel.tp_overlap (2d)."""
    grid = build_grid(mesh, grid_shape(mode, mesh.size("tp"), depth))
    layers, loss_fn, full_logits, gather_vocab = MODES[mode](grid, hidden, vocab_size, model, overlap)
    embeddings = {}  # id of a table -> its grid embedding: a head with the same weight is tied to it
    for name, style in match_plan(model, plan).items():  # parents before children, the embedding before the head
        style = HF_STYLES.get(style, style)
        if style not in layers:
            raise ValueError(f"tp_mode {mode!r} cannot place {name!r} as {style!r}")
        old = model.get_submodule(name)
        tied = style == "vocab_head" and id(old.weight) in embeddings
        new = layers["tied_head"](embeddings[id(old.weight)]) if tied else layers[style](old)
        if style == "vocab_embedding":
            embeddings[id(old.weight)] = new
        if new is not old:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return GridModel(model, loss_fn, full_logits, gather_vocab)


class GridLayer(Protocol):
    """A grid layer: its one parameter `weight`, and `full` that makes a tensor shaped like it whole."""
    weight: nn.Parameter

    def full(self, t: torch.Tensor) -> torch.Tensor: ...


GRID_LAYERS = (Linear2D, Embedding2D, RMSNorm2D, Linear3D, Embedding3D, RMSNorm3D)


def full_tensors(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{parameter name: the whole logical tensor} (or its gradient) of a grid-split model; collective over tp.
    A parameter outside the grid layers is whole on every rank already (tessel.parallel.tensor_nd.whole)."""
    out = {}
    for name, module in model.named_modules():
        for pname, p in module.named_parameters(recurse=False):
            t = p.grad if grads else p
            if not isinstance(module, GRID_LAYERS):
                out[f"{name}.{pname}"] = t.detach().clone()
            else:
                layer: GridLayer = module
                out[f"{name}.{pname}"] = layer.full(t) if pname == "weight" else layer.full_bias(t)
    return out


def describe_mode(mesh: Mesh, mode: str, tp: int, depth: int) -> str:
    coordinates = {"2d": "(row, col)", "2.5d": "(depth, row, col)", "3d": "(a, b, e) of the cube"}[mode]
    return describe_grid(mesh, grid_shape(mode, tp, depth), coordinates)



def apply_tensor_grid(plan: Plan, mesh: Mesh, parallel: ParallelConfig, family: ModelFamily, vocab_size: int,
                      hidden: int) -> Plan:
    """tessel.apply's tensor-parallel step in tp_mode 2d / 2.5d / 3d (1D's is tessel.parallel.tensor.apply): the
    family's TP plan (the reference GPT's, or a Hugging Face family's, derived from transformers' plan as it is
    declared), its modules made grid layers."""
    if mesh.size("tp") == 1 or parallel.tp_mode == "1d":
        return plan
    styles = family.grid_tp_plan(plan.model)
    if family.owns_loss:  # its loss on the grid's logits would be wrong
        refuse_own_loss(plan.model)
    done = apply_grid_mode(plan.model, styles, mesh, parallel.tp_mode, parallel.tp_depth, vocab_size, hidden,
                           parallel.tp_overlap)
    plan.loss_fn, plan.full_logits, plan.gather_vocab = done.loss_fn, done.full_logits, done.gather_vocab
    return plan
