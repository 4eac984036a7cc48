"""Activation recomputation: whole blocks (Chen et al. 2016, "Training Deep Nets with Sublinear Memory
Cost"), or only their attention cores (Korthikanti et al. 2022, "Reducing Activation Recomputation in
Large Transformer Models", selective recomputation).

Full: each transformer block keeps only its input for backward and runs its
forward again when backward reaches it (torch.utils.checkpoint, non-reentrant),
trading about one extra forward for the block's internal activations.

Selective: only the attention core (rotary, the shared kv heads, the attention
itself: tessel.models.gpt.Attention.core) keeps just its inputs, q, k and v;
the rotated copies, the attention's output and its softmax statistics are
rebuilt in backward. Korthikanti et al. choose this region because it holds
the activations that grow with the sequence (the T x T scores without a fused
kernel) while costing few FLOPs to recompute.

The forward (or core) is replaced on the instance rather than wrapping the
module in another one: a wrapper would add a level to every parameter name
(`layers.3.inner.attn...`), and checkpoints must keep the full model's names
in every layout.
"""

from __future__ import annotations

from typing import Iterable, Literal

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.models.gpt import Attention
from tessel.parallel.plan import Plan


class _Recomputed:
    """A forward that saves only its inputs and recomputes the rest in backward."""

    def __init__(self, forward):
        self.inner = forward

    def __call__(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def recompute_blocks(blocks: nn.ModuleList | list[nn.Module]) -> None:
    for block in blocks:
        if not isinstance(block.forward, _Recomputed):
            block.forward = _Recomputed(block.forward)


def recompute_attention_cores(modules: Iterable[nn.Module]) -> None:
    """Selective recomputation: the attention core of every reference-GPT Attention in `modules`."""
    for module in modules:
        if isinstance(module, Attention) and not isinstance(module.core, _Recomputed):
            module.core = _Recomputed(module.core)


def apply_recompute(plan: Plan, mesh: Mesh, recompute: Literal["none", "selective", "full"],
                    family: ModelFamily) -> Plan:
    """tessel.apply's step for parallel.recompute, after the pipeline's cut (a rank recomputes the blocks it
    holds) and before compile: selective on the reference GPT's attention cores (tessel.config refuses it for
    Hugging Face models), full on the family's decoder layers."""
    if recompute == "selective":
        recompute_attention_cores(plan.model.modules())
    elif recompute == "full":
        stages = list(plan.model) if mesh.size("pp") > 1 else [plan.model]  # a pipeline rank's chunks
        recompute_blocks([layer for stage in stages for layer in family.decoder_layers(stage)])
    return plan
