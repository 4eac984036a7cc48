"""Megatron tensor parallelism (1D) and sequence parallelism in the estimate (tessel.parallel.tensor).

Its collectives per chunk are tessel.planner.traffic.tp_chunk_calls (the f/g operators, Shoeybi et al.
2019; SP's g/g-bar, Korthikanti et al. 2022), priced on the tp group and, on a profiled machine, scaled by
what they measurably cost between the matmuls. Its memory term is autocast's bf16 copies of the fp32
weights; what a block keeps for backward under tp is tessel.planner.memory.layer_activation_bytes (read by
the recompute pricer, which decides what is kept).
"""

from __future__ import annotations

from tessel.planner import grid_cost
from tessel.planner.calibration import interpolate
from tessel.planner.cluster import Geometry
from tessel.planner.layout import Layout
from tessel.planner.memory import layer_activation_bytes
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.traffic import Call, sent_bytes, tp_chunk_calls


class TensorPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing
        self._memo: dict = {}

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        """The chunk's tp collectives (1D only: a grid's are tessel.planner.pricing.tensor_nd's)."""
        if layout.tp == 1 or grid_cost.layout_grid(layout) is not None:
            return None
        n_moe = sum(self.pricing.moe_flags[i] for i in chunk.layers)
        full = layout.recompute == "full"
        key = (len(chunk.layers) - n_moe, n_moe, chunk.first, chunk.last, layout.tp, layout.sequence_parallel, full, chunk.tokens)
        if key not in self._memo:  # thousands of layouts share a few chunk shapes (tp is innermost: its
            # group's geometry is tp's alone)
            self._memo[key] = self._priced(*key, self.pricing.groups(layout)["tp"])
        return self._memo[key]

    def _priced(self, n_dense: int, n_moe: int, first: bool, last: bool, tp: int, sp: bool, recompute: bool,
                tokens: int, geo: Geometry) -> ChunkComm:
        f, b = self.calls(n_dense, n_moe, tokens, sp, recompute, first, last)
        k = self._in_step_factor(tp, tokens, geo)
        tf, tb = self.pricing.price_group(f, geo), self.pricing.price_group(b, geo)
        return ChunkComm(k * tf.seconds, k * tb.seconds, {"tp": sent_bytes(f + b, tp)}, (tf, tb))

    def calls(self, n_dense: int, n_moe: int, tokens: int, sp: bool, recompute: bool, first: bool,
              last: bool) -> tuple[list[Call], list[Call]]:
        """(forward, backward) tp collectives of a chunk of n_dense + n_moe blocks (+ its edges)."""
        c = self.pricing.spec.cfg
        return tp_chunk_calls(c.d_model, c.vocab_size, tokens, self.pricing.act_bytes, n_dense, n_moe, sp,
                              recompute, first, last)

    def _in_step_factor(self, tp: int, tokens: int, geo: Geometry) -> float:
        """Measured in-step cost of tp collectives over their idle alpha-beta price (1 unprofiled).

        The probe times collectives that every rank enters at once; between matmuls the ranks
        of a tp group arrive apart (shared cores, OS scheduling) and wait for each other. The
        profile measured the whole model's tp collectives in a real forward+backward at this
        tp degree: that over the price of the same calls is the factor for this machine.
        """
        points = self.pricing.cal.tp_comm.get(tp)
        if tp <= 1 or not points:
            return 1.0
        n_moe = sum(self.pricing.moe_flags)  # the profiled model: every block, both edges, no SP or recompute
        f, b = self.calls(self.pricing.spec.cfg.n_layer - n_moe, n_moe, tokens, False, False, True, True)
        priced = self.pricing.price_group(f + b, geo).seconds
        measured = max(0.0, interpolate(points, tokens, priced))
        return measured / priced if priced > 0 else 1.0

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {"weight_copies": self.weight_copies(layout, stage)}

    def weight_copies(self, layout: Layout, stage: Stage) -> float:
        """bf16 copies of fp32 weights that autocast makes on each forward and autograd keeps until that
        micro-batch's backward: every in-flight chunk-forward holds its own (the cast cache lives for one
        autocast region). A fully recomputed block makes its copies inside the checkpoint: one block's."""
        p = self.pricing
        if p.act_bytes != 2 or p.param_bytes(layout) == 2 or layout.tp_mode != "1d":
            return 0.0  # a grid multiplies the blocks it holds or gathers (grid_cost.layer_activation_bytes)
        matrices = [sum(p.layer_params[i]) / layout.tp for i in stage.layers] or [0.0]
        if layout.recompute == "full":
            return 2 * max(matrices)
        return 2 * stage.in_flight * sum(matrices) / len(stage.chunks)

    def layer_bytes(self, layout: Layout, stage: Stage) -> list[float]:
        """Bytes each of the stage's blocks keeps for backward under 1D tp (SP splits the stream)."""
        p = self.pricing
        return [layer_activation_bytes(p.spec, stage.tokens, layout.tp, layout.sequence_parallel, p.precision, p.moe_flags[i])
                for i in stage.layers]

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms | None:
        return None

