"""Pipeline parallelism in the estimate (tessel.parallel.pipeline): which layers a stage holds, how many
micro-batches it keeps in flight, its messages, and one flush of the schedule.

The schedules are the runtime's own action lists (tessel.planner.schedule); GPipe, 1F1B and interleaved
1F1B are priced by closed forms here, the zero-bubble and asynchronous ones by tessel.planner.schedule.
"""

from __future__ import annotations

from tessel.planner.layout import Layout
from tessel.planner.memory import layer_activation_bytes
from tessel.planner.network import NONE, Cost
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.schedule import (NEW_SCHEDULES, captured_gradient_bytes, flush_time, held_bytes,
                                     held_micro_batches, stashed_versions)
from tessel.planner.traffic import pp_calls


def chunk_layers(n_layer: int, pp: int, v: int) -> list[list[int]]:
    """Layers of each model chunk 0..pp*v-1, balanced, earlier chunks take the remainder.

    Device s holds chunks s, s+pp, s+2pp, ... (interleaved assignment).
    """
    k = pp * v
    base, extra = divmod(n_layer, k)
    out, start = [], 0
    for c in range(k):
        n = base + (1 if c < extra else 0)
        out.append(list(range(start, start + n)))
        start += n
    return out


def peak_chunks_in_flight(schedule: str, pp: int, m: int, stage: int, v: int = 1) -> int:
    """Closed forms of schedule.peak_in_flight: GPipe m; 1F1B min(p-s, m);
    interleaved min(2(p-s-1) + (v-1)p + 1, m v) chunks (Narayanan et al. 2021)."""
    if pp == 1:
        return 1
    if schedule in NEW_SCHEDULES:  # read off the runtime's lists (tessel.planner.schedule)
        return held_micro_batches(schedule, pp, m, stage, v)[0]
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved":
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return min(pp - stage, m)


def pipeline_time(stage_busy: list[float], m: int, v: int, p2p: float) -> float:
    """One flush of the pipeline: m micro-batches over stages busy `stage_busy[s]` each per micro-batch.

    The busiest stage paces the steady state (m of its micro-batches); filling
    and draining adds the other stages' work once, spread over the v chunks a
    stage holds (Narayanan et al. 2021: interleaving shrinks the bubble v
    times), and each of the p*v - 1 chunk boundaries delays the first forward
    and the last backward by one message. Uniform stages give GPipe's and
    1F1B's (m + p - 1) t and the interleaved (m + (p-1)/v) t; an uneven stage
    (the head's) is charged for its own micro-batches, not v times per
    micro-batch. tests/planner/test_pipeline_pricing.py checks it against the
    event simulator replaying the runtime's own schedules (within 3% at even
    stages with the head). Chunks of unequal depth (a remainder of layers)
    move the fill and drain by whole chunks, which per-stage totals cannot
    see: the search re-prices its leaders' flushes with the simulator
    (tessel.planner.search.simulated).
    """
    p = len(stage_busy)
    if p == 1:
        return m * stage_busy[0]
    top = max(stage_busy)
    return m * top + (sum(stage_busy) - top) / v + 2 * (p * v - 1) * p2p


class PipelinePricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing

    def message_bytes(self, layout: Layout) -> float:
        """One pipeline message: a micro-batch's activation (sequence-sharded under SP)."""
        split = layout.sequence_parallel or layout.tp_mode != "1d"  # a grid splits the activation over all of its ranks
        spec = self.pricing.spec
        whole = layout.micro_batch * spec.seq_len * spec.cfg.d_model * self.pricing.act_bytes
        return whole / (layout.tp if split else 1) / layout.cp

    def message(self, layout: Layout) -> Cost:
        """One message between neighbouring stages, with the links it holds (none without a pipeline)."""
        if layout.pp == 1:
            return NONE
        return self.pricing.cost("p2p", self.message_bytes(layout), self.pricing.groups(layout)["pp"])

    def stage_links(self, layout: Layout, chunks, n_chunks: int, message: Cost) -> Cost:
        """The links one stage's messages of a step hold."""
        if layout.pp == 1:
            return NONE
        calls = pp_calls(self.message_bytes(layout), chunks, n_chunks, layout.chunks)
        return message.times(sum(c.count for c in calls))

    def flush(self, layout: Layout, chunk_times: list[list[tuple[float, float]]], stage_busy: list[float],
              message_s: float) -> float:
        """One flush: the closed forms (pipeline_time), or the split-backward and asynchronous schedules'."""
        if layout.schedule in NEW_SCHEDULES:
            return flush_time(layout.schedule, stage_busy, [sum(f for f, _ in row) for row in chunk_times],
                              layout.micro_batches, layout.virtual_stages, message_s)
        return pipeline_time(stage_busy, layout.micro_batches, layout.virtual_stages, message_s)

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        return None  # its messages are the stage's (stage_links), between chunks, not inside one

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        """A split backward's captured gradients, held from B to W (tessel.planner.schedule), and an
        asynchronous pipeline's stashed weight versions (fp32 copies of the stage's parameters)."""
        if layout.schedule not in NEW_SCHEDULES or layout.pp == 1:
            return {}
        p, c = self.pricing, self.pricing.spec.cfg
        tokens, per_chunk = stage.tokens, stage.layers_per_chunk
        held = held_micro_batches(layout.schedule, layout.pp, layout.micro_batches, stage.index, layout.virtual_stages)[0]
        one = captured_gradient_bytes(c.d_model, c.kv_heads * p.spec.head_dim, c.ffn_dim, tokens, layout.tp,
                                      p.act_bytes)
        if stage.last and not p.fused_loss:  # the head's: the logits' gradient (a fused
            # loss never holds it whole: its chunks' gradients are spent in the forward)
            one += tokens * c.vocab_size * p.act_bytes / layout.tp / per_chunk
        # what the captured gradients add at the moment the stage holds most (not at their own peak)
        act = per_chunk * self._mean_layer_bytes(layout, stage)
        joint = held_bytes(layout.schedule, layout.pp, layout.micro_batches, stage.index, layout.virtual_stages, act, per_chunk * one)
        out = {"captured_grads": joint - held * act}
        versions = stashed_versions(layout.schedule, held)
        if versions:
            out["weight_versions"] = versions * 4 * (stage.dense + stage.expert)
        return out

    def _mean_layer_bytes(self, layout: Layout, stage: Stage) -> float:
        p = self.pricing
        per_layer = [layer_activation_bytes(p.spec, stage.tokens, layout.tp, layout.sequence_parallel, p.precision, p.moe_flags[i])
                     for i in stage.layers] or [0.0]
        return sum(per_layer) / len(per_layer)

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms:
        """One flush of the micro-batches over the stages (one stage without a pipeline), every chunk's
        seconds as the stages' walk found them."""
        stage_busy = [sum(f + b for f, b in row) for row in chunk_times]
        return StepTerms(flush_s=self.flush(layout, chunk_times, stage_busy, self.message(layout).seconds))
