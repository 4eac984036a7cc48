"""Gradients that span ranks after a pipeline rank's backwards: data parallelism, ZeRO, tied embeddings.

- Data parallelism without ZeRO: one DataParallel per chunk (tessel.parallel.data.apply
  wraps them), reducing on that chunk's last backward, so the reduction of a chunk overlaps the backwards
  still to come on the rank (the pipeline's drain), as PTD-P does (Narayanan
  et al. 2021, sec. 4.2).
- ZeRO (Rajbhandari et al. 2020): one engine over all of the rank's chunks
  (tessel.parallel.zero.apply builds it),
  reducing after the rank's final backward; under ZeRO-3 the chunks'
  parameters are whole for the whole step (tessel.parallel.zero.pipeline).
- Tied embeddings (Press & Wolf 2017): the first stage's token embedding and
  the last stage's output head are copies of one weight; after the flush each
  copy's gradient becomes the sum of both.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.models.parts import ModelParts
from tessel.parallel.data.data_parallel import DataParallel
from tessel.parallel.pipeline.schedules import Placement
from tessel.parallel.zero.zero_parallel import ZeroDataParallel


class TiedEmbedding:
    """This rank's copy of the tied embedding (None on a middle rank) and the group of the two ends."""

    def __init__(self, mesh: Mesh, chunks: Sequence[nn.Module], placement: Placement, parts: ModelParts):
        self.group = None
        for ranks in mesh.all_groups(("pp",)):  # collective: every rank creates every pipeline's group
            g = dist.new_group([ranks[0], ranks[-1]])
            if mesh.rank in (ranks[0], ranks[-1]):
                self.group = g
        self.param: nn.Parameter | None = None
        for c, chunk in enumerate(chunks):
            if placement.is_first(c):
                self.param = chunk.get_parameter(parts.tied[0])
            if placement.is_last(c):
                self.param = chunk.get_parameter(parts.tied[1])

    def reduce(self) -> None:
        """Each of the two copies gets the sum of both gradients."""
        if self.group is None or self.param is None:
            return
        if self.param.grad is None:
            self.param.grad = torch.zeros_like(self.param)
        dist.all_reduce(self.param.grad, group=self.group)


class GradientSync:
    """When each of this rank's gradients is reduced, and what is summed after the flush."""

    def __init__(self, chunks: Sequence[nn.Module], zero: ZeroDataParallel | None = None,
                 tied: TiedEmbedding | None = None, dp: Sequence[DataParallel] | None = None):
        """zero or dp: what the DP/ZeRO step (tessel.parallel.zero.apply, tessel.parallel.data.apply) wrapped the
        chunks in: an engine over all of them, or one DataParallel per chunk (neither: no token axis spans ranks)."""
        self.dp = list(dp) if dp is not None else [None] * len(chunks)
        self.zero, self.tied = zero, tied
        # ZeRO-2/3 on a rank with a tied copy: reduce-scatter after the flush, once the copies
        # are summed. Stage 1 need not wait: its gradients stay whole, and summing the two
        # stages' dp-averaged copies afterwards gives the average of the sums.
        self.zero_after_flush = (zero is not None and zero.stage > 1
                                 and tied is not None and tied.param is not None)

    def before_backward(self, chunk: int, chunk_done: bool, rank_done: bool) -> None:
        """Arm the reductions a backward fires: the chunk's dp on its last, ZeRO on the rank's last."""
        dp = self.dp[chunk]
        if dp is not None:
            dp.sync_gradients = chunk_done
        if self.zero is not None:
            self.zero.sync_gradients = rank_done and not self.zero_after_flush

    def after_flush(self) -> None:
        if self.tied is not None:
            self.tied.reduce()
        if self.zero_after_flush:
            self.zero.reduce_gradients()

    @contextlib.contextmanager
    def whole_parameters(self) -> Iterator[bool]:
        """Every chunk's parameters whole for the duration: a step, an evaluation, a weight check.

        Only ZeRO-3 shards them at rest (tessel.parallel.zero.pipeline); it
        gathers them into new storages, and the context yields True then (False:
        nothing was gathered)."""
        if self.zero is None or self.zero.stage != 3:
            yield False
            return
        with self.zero.step_gathered():
            yield True
