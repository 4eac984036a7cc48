"""Activation recomputation in the estimate (tessel.parallel.recompute): what a stage keeps for backward, and
what its backward runs again.

None keeps every block's saved tensors for each chunk-forward in flight; full keeps each block's input and
rebuilds one block at a time; selective drops each attention core's tensors and rebuilds one core at a
time (Korthikanti et al. 2022). The blocks' bytes are the tensor pricers' (1D, or a grid's), less what the
ring of context parallelism saves; the workspace of a backward is the biggest block's (the ring's buffers
too) or the head's.
"""

from __future__ import annotations

from tessel.planner import grid_cost
from tessel.planner.layout import Layout
from tessel.planner.memory import (attention_core_bytes, head_activation_bytes, recompute_layer_bytes,
                                   unfused_attention_bytes)
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.pricing.context import ContextPricer
from tessel.planner.pricing.tensor import TensorPricer
from tessel.planner.pricing.tensor_nd import GridPricer


class RecomputePricer:
    def __init__(self, pricing: Pricing, tensor: TensorPricer, grid: GridPricer, context: ContextPricer):
        self.pricing, self.tensor, self.grid, self.context = pricing, tensor, grid, context

    @staticmethod
    def seconds(layout: Layout, blocks_fwd: float, cores_fwd: float) -> float:
        """What a chunk's backward runs again: every block's forward (full) or every attention core's."""
        return {"none": 0.0, "full": blocks_fwd, "selective": cores_fwd}[layout.recompute]

    def flops_per_token(self, layout: Layout) -> float:
        """FLOPs per token the recomputed forwards add: every block's forward (full), or every attention
        core's (selective). Counted by hardware FLOP/s, not by MFU."""
        if layout.recompute == "full":
            return sum(self.pricing.layer_flops)
        if layout.recompute == "selective":
            return self.pricing.spec.cfg.n_layer * self.pricing.attention_core_flops(1)
        return 0.0

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        one_layer, biggest = self._blocks(layout, stage)
        return {"activations": self._kept(layout, stage, one_layer, biggest) + self._workspace(layout, stage, biggest)}

    def _blocks(self, layout: Layout, stage: Stage) -> tuple[float, float]:
        """(mean, biggest) bytes a block of the stage keeps without recomputation."""
        p, tokens = self.pricing, stage.tokens
        if grid_cost.layout_grid(layout) is not None:
            per_layer = self.grid.layer_bytes(layout, stage)
        else:
            saving = self.context.ring_saving(layout, tokens)
            per_layer = [b - saving for b in self.tensor.layer_bytes(layout, stage)] or [0.0]
        one_layer, biggest = sum(per_layer) / len(per_layer), max(per_layer)  # mean over this device's blocks
        if not p.cluster.fused_attention:  # the T x T probabilities of every head
            scores = unfused_attention_bytes(p.spec, tokens, layout.tp, p.precision)
            one_layer, biggest = one_layer + scores, biggest + scores
        return one_layer, biggest

    def _kept(self, layout: Layout, stage: Stage, one_layer: float, biggest: float) -> float:
        """What the stage keeps for backward from its forwards in flight (one_layer: a block's mean bytes)."""
        p, tokens = self.pricing, stage.tokens
        layers = stage.in_flight * stage.layers_per_chunk
        if layout.recompute == "full":
            split = layout.sequence_parallel or grid_cost.layout_grid(layout) is not None
            return layers * recompute_layer_bytes(p.spec, tokens, layout.tp, split) + biggest  # one rebuilt at a time
        core = attention_core_bytes(p.spec, tokens, layout.tp, p.precision, p.cluster.fused_attention)
        if layout.recompute == "selective":
            return layers * (one_layer - core) + core  # one core rebuilt at a time
        return layers * one_layer

    def _workspace(self, layout: Layout, stage: Stage, biggest: float) -> float:
        """Backward of a block materialises gradients about as large as what it saved (the ring its blocks
        too); the head's backward comes first, when no block's has begun: the peak is the larger of the two."""
        p = self.pricing
        workspace = biggest + self.context.ring_buffers(layout, stage.tokens)
        if stage.last:
            workspace = max(workspace, head_activation_bytes(p.spec, stage.tokens, layout.tp, p.precision,
                                                             p.fused_loss))
        return workspace

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        return None  # the tensor, expert and context pricers repeat their forward's calls under full

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms | None:
        return None  # its seconds are in each chunk's backward (seconds)
