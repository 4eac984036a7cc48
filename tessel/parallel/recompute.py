"""Activation recomputation per block (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost").

Each transformer block keeps only its input for backward and runs its forward
again when backward reaches it (torch.utils.checkpoint, non-reentrant), trading
about one extra forward for the block's internal activations.

The block's own forward is replaced on the instance rather than wrapping the
block in another module: a wrapper would add a level to every parameter name
(`layers.3.inner.attn...`), and checkpoints must keep the full model's names
in every layout.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class _Recomputed:
    """A block's forward that saves only its inputs and recomputes the rest in backward."""

    def __init__(self, forward):
        self.inner = forward

    def __call__(self, *args, **kwargs):
        return checkpoint(self.inner, *args, use_reentrant=False, **kwargs)


def recompute_blocks(blocks: nn.ModuleList | list[nn.Module]) -> None:
    for block in blocks:
        if not isinstance(block.forward, _Recomputed):
            block.forward = _Recomputed(block.forward)
