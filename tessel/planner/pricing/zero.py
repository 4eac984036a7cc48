"""ZeRO in the estimate (tessel.parallel.zero): each rank's share of the parameters, gradients and optimizer
state (tessel.planner.memory.zero_state_bytes), the buffers its collectives hold, and the optimizer's update
of the shard it owns. Plain data parallelism is stage 0. The gradients' traffic is the data pricer's.
"""

from __future__ import annotations

from tessel.planner import grid_cost
from tessel.planner.layout import Layout
from tessel.planner.memory import zero_state_bytes
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import Pricing

ADAM_BYTES_TOUCHED = 28  # per parameter: read+write fp32 weight, m, v (24) + read the gradient (4)
CLIP_BYTES = 12  # per parameter of the gradient shard: the norm reads it, the clip scales it in place
PUBLISH_BYTES = 6  # bf16 storage: each updated fp32 master written back as bf16 (read 4, write 2)


class ZeroPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing

    def state_memory(self, dense: float, expert: float, layout: Layout) -> dict[str, float]:
        """Parameters, gradients and optimizer state of one device (tessel.planner.memory.zero_state_bytes):
        dense parameters sharded over dp x ep (x cp), experts over dp (x cp)."""
        pb, rb = self.pricing.param_bytes(layout), self.pricing.reduce_bytes(layout)
        whole = layout.pp > 1  # gradients accumulate whole over the micro-batches, reduce-scattered after the flush
        d = zero_state_bytes(dense, layout.zero_stage, layout.token_shards, pb, rb, whole)
        e = zero_state_bytes(expert, layout.zero_stage, layout.dp * layout.cp, pb, rb, whole)
        return {k: d[k] + e[k] for k in d}

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        out = self.state_memory(stage.dense, stage.expert, layout)
        out["buffers"] = self._transient(layout, stage) + self._workspace(layout, 4 * (stage.dense + stage.expert))
        return out

    def _transient(self, layout: Layout, stage: Stage) -> float:
        """What ZeRO's collectives hold for a moment beside the state."""
        p = self.pricing
        pb, params = p.param_bytes(layout), stage.dense + stage.expert
        if layout.zero_stage >= 3 and layout.pp > 1:  # under a pipeline the whole stage is gathered for the step
            return pb * params
        if layout.zero_stage >= 3:  # the gathered weights of the block being computed and the prefetched next
            return 2 * pb / 4 * p.largest_block_bytes(grid_cost.weight_shards(layout))
        if layout.zero_stage == 2:  # one bucket in flight, never more than the gradients it holds
            return min(p.bucket_bytes, p.reduce_bytes(layout) * params)
        return 0.0

    def _workspace(self, layout: Layout, param_bytes: float) -> float:
        """Host memory the backend's data-parallel collectives add (gloo works on copies; measured on this
        CPU and applied to it only: Cluster.workspace() is empty for a GPU preset).

        ZeRO-1/2 publish every parameter with all-gathers issued at once; ZeRO-2
        reduce-scatters a bucket at a time, ZeRO-3 gathers a block at a time;
        plain DP all-reduces a bucket at a time. param_bytes: this device's
        fp32 parameters before sharding (one bucket at most holds them all).
        """
        w = self.pricing.cluster.workspace()
        if not w or layout.token_shards == 1:
            return 0.0
        bucket = min(self.pricing.bucket_bytes, param_bytes)
        if layout.zero_stage in (1, 2):
            per_bucket = w.get("reduce_scatter" if layout.zero_stage == 2 else "all_reduce", 0.0)
            return w.get("all_gather", 0.0) * param_bytes + per_bucket * bucket
        if layout.zero_stage >= 3:
            block = self.pricing.largest_block_bytes(grid_cost.weight_shards(layout))
            return w.get("all_gather", 0.0) * min(block, param_bytes) + w.get("reduce_scatter", 0.0) * block
        return w.get("all_reduce", 0.0) * bucket

    def step(self, layout: Layout, chunk_times, memory: dict[str, float]) -> StepTerms:
        """The optimizer's update of the shard this device owns: no communication overlaps it."""
        return StepTerms(fixed_s=self.optimizer_seconds(memory, layout))

    def optimizer_seconds(self, memory: dict[str, float], layout: Layout) -> float:
        p = self.pricing
        n_params = memory["optimizer"] / (8 if p.param_bytes(layout) == 4 else 12)  # the shard this device updates
        if p.cal.opt_s_per_param is not None:
            return n_params * p.cal.opt_s_per_param
        per_param = ADAM_BYTES_TOUCHED
        if p.roofline:  # the clip reads and scales the gradient shard; bf16 storage publishes the masters
            per_param += CLIP_BYTES + (PUBLISH_BYTES if p.param_bytes(layout) == 2 else 0)
            return n_params * per_param / (p.cluster.mem_bandwidth * p.cluster.hbm_efficiency)
        return n_params * per_param / p.cluster.mem_bandwidth

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        return None  # ZeRO-3's gathers are the dp group's traffic (the data pricer)
