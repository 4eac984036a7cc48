"""Apply a 2D / 2.5D / 3D tensor-parallel mode to the reference GPT, from the same plan as 1D.

The reference GPT's TP plan (tessel.models.plan, module name -> Megatron style) says what each
module is; here each style maps to its grid layer instead: a column- or row-parallel linear
becomes the mode's linear (both sides of a matmul are split on the grid, so the two kinds
coincide), the vocab embedding and head the mode's, a norm the mode's norm. Attention and the
SwiGLU need no change: the heads and the feed-forward split over the grid's columns, and the
reference model reads head counts from tensor shapes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol

import torch
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.tensor.tensor_parallel import match_plan
from tessel.parallel.tensor_nd.cube import MIXED, STREAM, Cube, Embedding3D, FullLogits3D, Linear3D, Loss3D, RMSNorm3D
from tessel.parallel.tensor_nd.grid import Grid, build_grid, describe_grid
from tessel.parallel.tensor_nd.summa import Embedding2D, FullLogits2D, Linear2D, Loss2D, RMSNorm2D, Summa

GRID_SHAPES: dict[str, Callable[[int, int], tuple[int, ...]]] = {
    "2d": lambda tp, depth: (round(tp ** 0.5),) * 2,
    "2.5d": lambda tp, depth: (depth, *(round((tp // depth) ** 0.5),) * 2),
    "3d": lambda tp, depth: (round(tp ** (1 / 3)),) * 3,
}


@dataclass
class GridModel:
    """What a grid mode hands tessel.apply: the model, its loss and logits for sampling."""
    model: nn.Module
    loss_fn: Callable
    full_logits: Callable


def grid_shape(mode: str, tp: int, depth: int = 1) -> tuple[int, ...]:
    return GRID_SHAPES[mode](tp, depth)


Layers = dict[str, Callable[[nn.Module], nn.Module]]


def activation_shards(mode: str, tp: int, depth: int = 1) -> tuple[int, int]:
    """(batch chunks, hidden chunks) of an activation on the grid: what a pipeline stage sends. (1, 1) in 1D."""
    if mode == "1d" or tp == 1:
        return 1, 1
    side = grid_shape(mode, tp, depth)[-1]
    return {"2d": side, "2.5d": side * depth, "3d": side * side}[mode], side


def _summa_mode(grid: Grid, hidden: int, vocab_size: int, model: nn.Module) -> tuple[Layers, Callable, Callable]:
    """2D, and 2.5D (SUMMA in each depth layer): the layers, the loss, the sampling logits."""
    s = Summa(grid)
    linear = lambda m: Linear2D(m, s)
    layers = {"colwise": linear, "rowwise": linear, "vocab_head": linear,
              "vocab_embedding": lambda m: Embedding2D(m, s),
              "sequence_norm": lambda m: RMSNorm2D(m, s, hidden), "enter": lambda m: m}
    return layers, Loss2D(s, vocab_size), FullLogits2D(model, s)


def _cube_mode(grid: Grid, hidden: int, vocab_size: int, model: nn.Module) -> tuple[Layers, Callable, Callable]:
    """3D: layers that read the residual stream take its layout to the mixed one, those that write it back."""
    cube = Cube(grid)
    layers = {"colwise": lambda m: Linear3D(m, cube, STREAM), "vocab_head": lambda m: Linear3D(m, cube, STREAM),
              "rowwise": lambda m: Linear3D(m, cube, MIXED),
              "vocab_embedding": lambda m: Embedding3D(m, cube),
              "sequence_norm": lambda m: RMSNorm3D(m, cube, hidden), "enter": lambda m: m}
    return layers, Loss3D(cube, vocab_size), FullLogits3D(model, cube)


MODES = {"2d": _summa_mode, "2.5d": _summa_mode, "3d": _cube_mode}


def apply_grid_mode(model: nn.Module, plan: dict[str, str], mesh: Mesh, mode: str, depth: int,
                    vocab_size: int) -> GridModel:
    """Swap the plan's modules for the mode's grid layers, in place (collective: builds the grid's groups)."""
    grid = build_grid(mesh, grid_shape(mode, mesh.size("tp"), depth))
    layers, loss_fn, full_logits = MODES[mode](grid, model.cfg.d_model, vocab_size, model)
    for name, style in match_plan(model, plan).items():  # parents before children
        if style not in layers:
            raise ValueError(f"tp_mode {mode!r} cannot place {name!r} as {style!r}")
        new = layers[style](model.get_submodule(name))
        if new is not model.get_submodule(name):
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return GridModel(model, loss_fn, full_logits)


class GridLayer(Protocol):
    """A grid layer: its one parameter `weight`, and `full` that makes a tensor shaped like it whole."""
    weight: nn.Parameter

    def full(self, t: torch.Tensor) -> torch.Tensor: ...


GRID_LAYERS = (Linear2D, Embedding2D, RMSNorm2D, Linear3D, Embedding3D, RMSNorm3D)


def full_tensors(model: nn.Module, grads: bool = False) -> dict[str, torch.Tensor]:
    """{parameter name: the whole logical tensor} (or its gradient) of a grid-split model; collective over tp."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, GRID_LAYERS):
            layer: GridLayer = module
            t = layer.weight.grad if grads else layer.weight
            out[f"{name}.weight"] = layer.full(t)
    return out


def describe_mode(mesh: Mesh, mode: str, tp: int, depth: int) -> str:
    coordinates = {"2d": "(row, col)", "2.5d": "(depth, row, col)", "3d": "(a, b, e) of the cube"}[mode]
    return describe_grid(mesh, grid_shape(mode, tp, depth), coordinates)

