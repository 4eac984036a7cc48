"""What a pipeline runner runs, in one record: the schedule, the micro-batches, the shapes and the loss."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from tessel.parallel.runner import LossFn


@dataclass(frozen=True)
class PipelineSpec:
    schedule: str  # gpipe | 1f1b | interleaved | zb-h1 | zb-h2 | zbv (schedules.py)
    micro_batches: int  # per step: grad_accum x parallel.micro_batches
    d_model: int  # the width of the activations that cross stages
    loss_fn: LossFn  # (logits, targets) -> mean loss, on the last stage
    precision: str = "fp32"
    seq_shards: int = 1  # sequence parallelism: stages exchange (B, T/seq_shards, C), each tp rank its tokens
    # a 2D / 2.5D / 3D tp grid (tessel.parallel.tensor_nd): each rank holds a batch chunk and a hidden chunk
    grid_shards: tuple[int, int] = (1, 1)  # (batch chunks, hidden chunks)
    vocab_size: int | None = None
    max_seq_len: int | None = None
    gather_vocab: Callable[[torch.Tensor], torch.Tensor] | None = None  # TP: the last stage's logits are shards
    extra_metrics: Callable[[], dict[str, float]] | None = None  # e.g. MoE routing stats of this rank's blocks
    blocks: str = "layers"  # the block list in a stage (ModelParts.blocks): a split backward's first-stage cut
    # one per chunk: what its forward adds to the loss (aux.StageLoss); None: its MoE blocks' aux losses
    stage_losses: tuple | None = None

    def act_shape(self, batch: int, seq: int) -> tuple[int, int, int]:
        """The (B, T, C) of this rank's activation (and gradient) messages for a micro-batch of (batch, seq)."""
        rows, width = self.grid_shards
        return batch // rows, seq // self.seq_shards, self.d_model // width
