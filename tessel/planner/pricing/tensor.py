"""Megatron tensor parallelism (1D) and sequence parallelism in the estimate (tessel.parallel.tensor).

Its collectives per chunk are tessel.planner.traffic.tp_chunk_calls (the f/g operators, Shoeybi et al.
2019; SP's g/g-bar, Korthikanti et al. 2022), priced on the tp group and, on a profiled machine, scaled by
what they measurably cost between the matmuls. Under tp_overlap (tessel.parallel.tensor.overlap) each dense
block's sequence gathers and reduce-scatters run as tp - 1 ring steps beside the matmuls they feed or take
from, and only what outlasts those matmuls is on the critical path (exposed_ring). Its memory term is
autocast's bf16 copies of the fp32 weights; what a block keeps for backward under tp is
tessel.planner.memory.layer_activation_bytes (read by the recompute pricer, which decides what is kept).
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


def exposed_ring(comm_s: float, compute_s: float, tp: int) -> float:
    """Seconds of a collective that a ring decomposition leaves exposed beside the matmul it feeds or takes
    from (Wang et al. 2023): its tp - 1 transfers of comm_s / (tp - 1) each run beside one of the matmul's tp
    pieces (compute_s / tp), so each step exposes max(0, comm - overlapped compute); summed."""
    if tp <= 1:
        return comm_s
    steps = tp - 1
    return steps * max(0.0, comm_s / steps - compute_s / tp)


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
        overlap = layout.tp_overlap and layout.sequence_parallel
        key = (len(chunk.layers) - n_moe, n_moe, chunk.first, chunk.last, layout.tp, layout.sequence_parallel, full,
               chunk.tokens, overlap)
        if key not in self._memo:  # thousands of layouts share a few chunk shapes (tp is innermost: its
            # group's geometry is tp's alone)
            self._memo[key] = self._priced(*key, self.pricing.groups(layout)["tp"])
        return self._memo[key]

    def _priced(self, n_dense: int, n_moe: int, first: bool, last: bool, tp: int, sp: bool, recompute: bool,
                tokens: int, overlap: bool, geo: Geometry) -> ChunkComm:
        f, b = self.calls(n_dense, n_moe, tokens, sp, recompute, first, last)
        k = self._in_step_factor(tp, tokens, geo)
        tf, tb = self.pricing.price_group(f, geo), self.pricing.price_group(b, geo)
        hf, hb = self.hidden(n_dense, tokens, tp, recompute, k, geo) if overlap else (0.0, 0.0)
        return ChunkComm(k * tf.seconds - hf, k * tb.seconds - hb, {"tp": sent_bytes(f + b, tp)}, (tf, tb))

    def hidden(self, n_dense: int, tokens: int, tp: int, recompute: bool, k: float,
               geo: Geometry) -> tuple[float, float]:
        """(forward, backward) seconds of the dense blocks' sequence gathers and reduce-scatters that tp_overlap
        hides behind their matmuls. Forward: the gather beside the region's column matmuls, the reduce-scatter
        beside the row matmul; backward the conjugates, beside the input and weight gradients' matmuls (twice
        the forward's FLOPs). A recomputed block's forward hides its collectives again."""
        act = tokens * self.pricing.spec.cfg.d_model * self.pricing.act_bytes
        ag = k * self.pricing.cost("all_gather", act, geo).seconds
        rs = k * self.pricing.cost("reduce_scatter", act, geo).seconds
        speed = self.pricing.flops_per_s(tokens, tp)  # the tp group's: a rank's share of a matmul / speed
        fwd = bwd = 0.0
        for column, row in self._regions():
            col_s, row_s = column * tokens / speed, row * tokens / speed
            fwd += ag + rs - exposed_ring(ag, col_s, tp) - exposed_ring(rs, row_s, tp)
            bwd += rs + ag - exposed_ring(rs, 2 * col_s, tp) - exposed_ring(ag, 2 * row_s, tp)
        return n_dense * fwd, n_dense * (bwd + (fwd if recompute else 0.0))

    def _regions(self) -> list[tuple[float, float]]:
        """(column, row) forward FLOPs per token of a dense block's two regions (attention, feed-forward)."""
        block = next((b for b in self.pricing.spec.blocks if b.mlp is not None), None)
        if block is None:
            return []
        heads = block.attention.projections
        attention = (sum(2 * i * o for i, o, side in heads if side == "out"),
                     sum(2 * i * o for i, o, side in heads if side == "in"))
        mlp = block.mlp
        return [attention, (2 * (mlp.matrices - 1) * mlp.d_model * mlp.width, 2 * mlp.width * mlp.d_model)]

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

