"""Plan: what the apply steps (tessel/parallel/<strategy>/apply.py) hand each other.

Each step takes the plan, the mesh and its config sections and returns the plan
with the model changed in place or replaced (a pipeline rank's chunks, a
wrapper); tessel.apply runs them in their fixed order and builds the runner from
the last plan. Fields that hold a strategy's own objects are typed loosely here,
so that this module imports no strategy (each strategy's step imports it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch.nn as nn

from tessel.models.gpt import cross_entropy
from tessel.models.parts import GPT_PARTS, ModelParts


@dataclass
class Plan:
    """What the steps hand each other: the (local) model and how to score it."""
    model: nn.Module  # the model, or under pp this rank's chunks (an nn.ModuleList)
    loss_fn: Callable = cross_entropy
    full_logits: Callable | None = None  # logits over the whole vocabulary, for sampling
    optimizer: Any = None  # a strategy that shards the optimizer (ZeRO) supplies it
    extra_metrics: Callable[[], dict] | None = None  # per-step metrics for the trainer's row
    # what runs after each optimizer step (MoE bias balancing), collective over the ranks that split the batch
    after_update: list[Callable[[], None]] = field(default_factory=list)
    gather_vocab: Callable | None = None  # vocab-sharded logits -> full (a pipeline's last stage samples)
    parts: ModelParts = GPT_PARTS  # where a pipeline cuts the model (a Hugging Face family's, or the GPT's)
    cp: Any = None  # CPContext (tessel.parallel.context): generation switches it to whole sequences
    stage_losses: list | None = None  # a pipeline chunk's part of a loss that spans stages (an HF MoE's router loss)
    # what joins the head's loss (MoE aux losses, an HF MoE's router loss): each wraps the loss it is given, once
    # the head's loss is final (apply_fused_loss replaces it after the steps that add these)
    loss_terms: list[Callable[[Callable], Callable]] = field(default_factory=list)
    fused: Any = None  # FusedHead (tessel.parallel.fused_loss), train.fused_loss: the head whose matmul moved
    # under pp, how the chunks' gradients span the token axes (the DP/ZeRO step's, for the pipeline's GradientSync):
    zero: Any = None  # ZeroDataParallel over all of this rank's chunks
    chunk_dp: list | None = None  # or one DataParallel per chunk (None: no token axis spans ranks)

    def loss(self) -> Callable:
        """The head's loss with what joins it."""
        loss = self.loss_fn
        for term in self.loss_terms:
            loss = term(loss)
        return loss
