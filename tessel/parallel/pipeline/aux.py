"""MoE auxiliary losses under pipeline parallelism: each stage back-propagates its own.

The router losses of an MoE block are scalars made on the stage that holds the
block, but the training loss is formed on the last stage. Instead of shipping
them down the pipeline, a stage ties its aux losses to its output activation
with an identity whose backward also seeds d(step loss)/d(aux) = scale into the
aux loss (Megatron-LM's MoEAuxLossAutoScaler does the same). The gradient then
reaches the router on the stage where it lives, inside the stage's own backward.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn

from tessel.models.moe import moe_layers


class AttachAuxLoss(torch.autograd.Function):
    """forward: x -> x (aux rides along); backward: dx = dy, d(aux) = scale.

    Megatron-LM, moe_utils.MoEAuxLossAutoScaler (Shoeybi et al. 2019 code base)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class StageLoss(Protocol):
    """What one chunk's latest training forward adds to the step's loss (None: nothing); `present`: whether
    it ever adds anything (the runner then sums the step's loss over the pipeline)."""
    present: bool

    def __call__(self) -> torch.Tensor | None: ...


class StageAux:
    """The sum of one chunk's MoE aux losses from its latest forward (None: no MoE block). A family whose
    aux loss spans stages brings a StageLoss of its own (tessel.parallel.expert.cross_stage: Mixtral's)."""

    def __init__(self, chunk: nn.Module):
        self.layers = moe_layers(chunk)
        self.present = bool(self.layers)

    def __call__(self) -> torch.Tensor | None:
        losses = [m.aux_loss for m in self.layers if m.aux_loss is not None]
        return torch.stack([a.float() for a in losses]).sum() if losses else None
