"""The trainer's bookkeeping in the estimate (tessel.train: its gradient norm, a pipeline's loss and metrics):
the per-step collectives beyond the calibration's overhead, which holds the world-wide ones
(tessel.planner.traffic.trainer_calls).

The calls are tessel.planner.traffic.bookkeeping_calls: the gradient norm's partial sums over tp, pp and
(under ZeRO) dp x ep, the pipeline's loss message and its two metric all-reduces, and with tied embeddings
the first and last stages' all-reduce of the embedding's gradient. They wait on the step's end, so they sit
on the critical path and overlap nothing; they hold their links like any collective.
"""

from __future__ import annotations

from dataclasses import replace

from tessel.planner.layout import Layout
from tessel.planner.network import NONE
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.traffic import Call, bookkeeping_calls


class TrainerPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing

    def calls(self, layout: Layout, stage: int = 0) -> dict[str, list[Call]]:
        """One rank of pipeline stage `stage`'s bookkeeping calls in a step, by group ("tp", "pp", "dp",
        "tied")."""
        c = self.pricing.spec.cfg
        tied = 4 * c.vocab_size * c.d_model / layout.tp if c.tie_embeddings and layout.pp > 1 else 0.0
        return bookkeeping_calls(layout.tp, layout.pp, layout.token_shards, layout.zero_stage, stage, tied)

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        return None  # the trainer issues its calls around the step, not inside a chunk

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {}

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms:
        """Stage 0's bookkeeping calls, each on its group (the tied embedding's: the first and last stages)."""
        geo = self.pricing.groups(layout)
        groups = {"tp": geo["tp"], "pp": geo["pp"], "dp": geo["dp"], "tied": replace(geo["pp"], n=2)}
        total = NONE
        for group, calls in self.calls(layout).items():
            total = total + self.pricing.price_group(calls, groups[group])
        return StepTerms(overhead_s=total.seconds, links=total)
