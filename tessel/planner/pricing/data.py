"""Data parallelism's traffic in the estimate (tessel.parallel.data, and ZeRO's collectives): the gradients'
reductions and the parameters' gathers over dp x ep (x cp), whatever the ZeRO stage.

The calls are tessel.planner.traffic.dp_step_calls. Bucketed gradient reductions overlap the backward that
fills the buckets (Li et al. 2020) as far as the cluster's measured overlap allows, all but the last bucket;
ZeRO-3's weight gathers are prefetched under the micro-batch's compute (Rajbhandari et al. 2020); the
all-gather of the updated shards after the optimizer step (stages 1, 2) is exposed. What hides behind
compute still holds the links: the step's link bound (the estimate) sees all of it.
"""

from __future__ import annotations

from tessel.planner import grid_cost
from tessel.planner.layout import Layout
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing
from tessel.planner.pricing.pipeline import chunk_layers
from tessel.planner.traffic import Call, dp_step_calls, sent_bytes

REDUCTIONS = ("all_reduce", "reduce_scatter")


class DataPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing

    def calls(self, layout: Layout, grad_bytes: float, chunks, all_chunks) -> tuple[list[Call], list[Call]]:
        """(per micro-batch, per step) dp x ep calls of a rank holding `chunks`, `grad_bytes` of whole
        fp32 gradients: ZeRO-3's units are the blocks of its first chunk, the root the rest. Under
        bf16 storage the gathers move bf16 parameters and the reductions the reduce dtype's gradients."""
        p = self.pricing
        units = [4 * sum(p.layer_params[i]) / grid_cost.weight_shards(layout) for i in all_chunks[chunks[0]]]
        root = max(0.0, grad_bytes - sum(units))  # embedding, head, final norm on this stage
        per_mb, per_step = dp_step_calls(grad_bytes, layout.zero_stage, p.bucket_bytes, units, root,
                                         whole_step=layout.pp > 1)
        pb, rb = p.param_bytes(layout), p.reduce_bytes(layout)
        if pb == 4 and rb == 4:
            return per_mb, per_step
        scale = {"all_gather": pb / 4, "all_reduce": rb / 4, "reduce_scatter": rb / 4}
        return ([Call(x.op, x.nbytes * scale[x.op], x.count) for x in per_mb],
                [Call(x.op, x.nbytes * scale[x.op], x.count) for x in per_step])

    def step(self, layout: Layout, chunk_times: list[list[tuple[float, float]]],
             memory: dict[str, float]) -> StepTerms | None:
        """Exposed seconds, links and bytes of the step's dp x ep traffic; extra: its total seconds and the
        network model's (reduce-scatters per micro-batch, per step, gathers per micro-batch), which the
        simulator replays (Estimate.dp_comm_s, dp_mb_s, dp_step_s, dp_gather_mb_s)."""
        n = layout.token_shards
        if n == 1:
            return None
        p = self.pricing
        g = p.groups(layout)["dp"]
        sharded = layout.zero_stage >= 2 and layout.pp == 1  # under a pipeline the step's gradients stay whole
        # unsharded fp32-equivalent gradient bytes (the call lists count fp32 buffers)
        grads_full = 4 * (memory["grads"] / p.reduce_bytes(layout)) * (n if sharded else 1)
        per_mb, per_step = self.calls(layout, grads_full, [0], chunk_layers(p.spec.cfg.n_layer, layout.pp, 1))
        reduce_step = p.price_group([c for c in per_step if c.op in REDUCTIONS], g)
        gather_step = p.price_group([c for c in per_step if c.op == "all_gather"], g)
        rs = p.price_group([c for c in per_mb if c.op == "reduce_scatter"], g)
        ag = p.price_group([c for c in per_mb if c.op == "all_gather"], g)
        exposed_mb, exposed_step = self._exposed(layout, chunk_times, per_mb or per_step, rs, ag, reduce_step)
        exposed_step += gather_step.seconds
        total = (rs.seconds + ag.seconds) * layout.chunks + reduce_step.seconds + gather_step.seconds
        sent = sent_bytes(per_mb, n) * layout.chunks + sent_bytes(per_step, n)
        links = (rs + ag).times(layout.chunks) + reduce_step + gather_step
        extra = {"total_s": total, "mb_s": rs.seconds, "step_s": reduce_step.seconds + gather_step.seconds,
                 "gather_mb_s": ag.seconds}
        return StepTerms(exposed_s=exposed_mb * layout.chunks + exposed_step, links=links, sent={"dp": sent},
                         extra=extra)

    def _exposed(self, layout: Layout, chunk_times, reductions: list[Call], rs, ag, reduce_step) -> tuple[float, float]:
        """(per micro-batch, per step) seconds of dp traffic that compute does not hide: one bucket's
        reduction at a time hides behind the rest of backward, ZeRO-3's gathers behind a micro-batch."""
        ov = self.pricing.cluster.overlap
        nb = max(1, sum(c.count for c in reductions if c.op in REDUCTIONS))
        bwd_stage = max(sum(b for _, b in row) for row in chunk_times)
        exposed_step = reduce_step.seconds - ov * min(reduce_step.seconds * (1 - 1 / nb), bwd_stage)
        exposed_mb = rs.seconds - ov * min(rs.seconds * (1 - 1 / nb), bwd_stage)
        if ag.seconds:
            compute = min(sum(f + b for f, b in row) for row in chunk_times)  # one micro-batch on one stage
            exposed_mb += max(ag.seconds * (1 - ov), ag.seconds - ov * compute)
        return exposed_mb, exposed_step

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        return None  # its traffic is the step's (ZeRO-3's per micro-batch included)

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {}  # the state it replicates or shards is the zero pricer's
