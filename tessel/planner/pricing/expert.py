"""Expert parallelism in the estimate (tessel.parallel.expert): each MoE block's all-to-alls over ep.

The calls are tessel.planner.traffic.ep_chunk_calls (the per-expert counts, the tokens out and back, and
backward's mirror), priced on the ep group; full recomputation repeats the forward's. Experts' parameters
are split over ep (Pricing.stage_params) and their state over dp x cp (the zero pricer). Shared experts
(model.n_shared_experts) are priced as the dense SwiGLU every token passes (tessel.planner.compute,
shared_expert_ops) and held whole by every ep rank.

Dropless experts (model.capacity_factor = 0) take whatever the router sends, and the ranks wait for the
busiest: tessel.planner.traffic.dropless_rows prices each rank's grouped GEMM, and its share of the
all-to-all, at the busiest rank's rows.
"""

from __future__ import annotations

from tessel.planner.layout import Layout
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.traffic import Call, ep_chunk_calls, sent_bytes, sent_rows_factor


class ExpertPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing
        self._memo: dict = {}

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        n_moe = sum(self.pricing.moe_flags[i] for i in chunk.layers)
        if not n_moe or layout.ep == 1:
            return None
        full = layout.recompute == "full"
        key = (n_moe, full, chunk.tokens, layout.ep, layout.cp, layout.tp)  # the ep group's geometry: ep, cp, tp
        if key not in self._memo:
            geo = self.pricing.groups(layout)["ep"]
            f, b = self.calls(n_moe, chunk.tokens, full, layout.ep)
            ef, eb = self.pricing.price_group(f, geo), self.pricing.price_group(b, geo)
            self._memo[key] = ChunkComm(ef.seconds, eb.seconds, {"ep": sent_bytes(f + b, layout.ep)}, (ef, eb))
        return self._memo[key]

    def calls(self, n_moe: int, tokens: int, recompute: bool, ep: int = 1) -> tuple[list[Call], list[Call]]:
        """(forward, backward) all-to-alls of a chunk's n_moe MoE blocks for one micro-batch over ep ranks."""
        spec = self.pricing.spec
        rows = sent_rows_factor(spec.cfg.capacity_factor, spec.moe_top_k * tokens, ep)
        return ep_chunk_calls(spec.cfg.d_model, tokens, self.pricing.act_bytes, spec.moe_top_k, rows,
                              spec.n_experts, n_moe, recompute)

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {}

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms | None:
        return None

