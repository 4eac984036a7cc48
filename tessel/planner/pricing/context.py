"""Context parallelism in the estimate (tessel.parallel.context); the formulas are tessel.planner.context's.

Per chunk: each block's ring hops (or Ulysses' all-to-alls), the ring's hidden behind the attention core
computed meanwhile. Per block kept: the ring's saving (k and v at kv width) and its backward's buffers.
"""

from __future__ import annotations

from tessel.config import compute_bytes
from tessel.planner.cluster import Geometry
from tessel.planner.context import cp_block_calls, mlp_half_bytes, ring_backward_bytes, ring_exposed, ring_kv_saving
from tessel.planner.layout import Layout
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.traffic import Call, sent_bytes


class ContextPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        """The chunk's cp calls for a micro-batch: the ring's hops hide behind the blocks of the attention core
        (forward's once, backward's twice its work)."""
        if layout.cp == 1:
            return None
        geo: Geometry = self.pricing.groups(layout)["cp"]
        f, b = self.calls(layout, chunk.tokens)
        fc, bc = self.pricing.price_group(f, geo), self.pricing.price_group(b, geo)
        n = len(chunk.layers)
        if layout.cp_mode == "ring":
            core = self._core_seconds(layout, chunk.tokens)
            # cp - 1 steps pass blocks while one computes; backward's last hop (the gradient home) waits
            fwd = ring_exposed(fc.seconds, layout.cp - 1, core, layout.cp) * n
            bwd = ring_exposed(bc.seconds, layout.cp - 1, 2 * core, layout.cp) * n
        else:
            fwd, bwd = fc.seconds * n, bc.seconds * n
        sent = sent_bytes(f + b, 2 if layout.cp_mode == "ring" else layout.cp) * n
        return ChunkComm(fwd, bwd, {"cp": sent}, ((fc + bc).times(n),), "cp comm")

    def calls(self, layout: Layout, tokens: int) -> tuple[list[Call], list[Call]]:
        """One block's cp calls for `tokens` local tokens; full recompute repeats the forward's in backward."""
        q, kv = self._widths(layout)
        f, b = cp_block_calls(layout.cp_mode, layout.cp, tokens, q, kv, self.pricing.act_bytes)
        return f, (b + f if layout.recompute == "full" else b)

    def _widths(self, layout: Layout) -> tuple[int, int]:
        """Query and key/value widths (heads x head_dim) on one tp rank."""
        c, head_dim = self.pricing.spec.cfg, self.pricing.spec.head_dim
        return c.n_head // layout.tp * head_dim, max(1, c.kv_heads // layout.tp) * head_dim

    def _core_seconds(self, layout: Layout, tokens: int) -> float:
        """Forward seconds of one block's attention core on `tokens` local tokens."""
        p = self.pricing
        if p.roofline:
            return p.block(p.shape(layout, tokens, False))[2]
        return p.attention_core_flops(tokens) / p.flops_per_s(tokens, layout.tp)

    def ring_saving(self, layout: Layout, tokens: int) -> float:
        """Bytes a block keeps less than without cp (ring only)."""
        if layout.cp == 1 or layout.cp_mode != "ring":
            return 0.0
        q, kv = self._widths(layout)
        return ring_kv_saving(tokens, q, kv, compute_bytes(self.pricing.precision))

    def ring_buffers(self, layout: Layout, tokens: int) -> float:
        """What the ring's backward adds to a block's: its buffers, less the MLP half's saved bytes already freed."""
        if layout.cp == 1 or layout.cp_mode != "ring":
            return 0.0
        q, kv = self._widths(layout)
        p, c = self.pricing, self.pricing.spec.cfg
        freed = mlp_half_bytes(tokens, c.d_model, c.ffn_dim, layout.tp, layout.sequence_parallel, p.precision)
        return max(0.0, ring_backward_bytes(tokens, q, kv, compute_bytes(p.precision)) - freed)

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {}

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms | None:
        return None
