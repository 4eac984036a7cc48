"""The cost model: FLOPs, memory and communication of one training step under a layout.

Everything is per device and per optimizer step, for tessel's reference GPT (or a Hugging Face family's
blocks, tessel.planner.model_spec). CostModel composes the strategies' pricers (tessel.planner.pricing:
data, zero, tensor, tensor_nd, context, pipeline, expert, recompute, trainer), each of which prices what its
strategy adds; what they share (the model's sizes, a collective's price on a group, a block's compute) is
tessel.planner.pricing.base.Pricing, which CostModel is. The hand-checkable pieces (collective times,
activation bytes, in-flight micro-batches, ZeRO shards) are small functions with unit tests in
tests/planner/test_cost.py.

The estimate walks every pipeline stage's chunks: each chunk's compute (Pricing.chunk_compute) plus what
recomputation runs again and the collectives the pricers issue inside it; then the pricers' step terms
(the pipeline's flush over the stages, the data-parallel traffic's exposed part, the optimizer's update,
the trainer's bookkeeping).

Links are shared: every collective and message also holds its device's NVLink or NIC for a while, and a
step is never shorter than its busiest link's total (nor than its compute), however much of that traffic
overlaps compute.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, replace

from tessel.config import compute_dtype
from tessel.planner import grid_cost
from tessel.planner.calibration import Calibration
from tessel.planner.cluster import Cluster, Link, link_for
from tessel.planner.compute import step_gemms
from tessel.planner.context import local_tokens
from tessel.planner.gemm import Gemm
from tessel.planner.layout import Layout
from tessel.planner.model_spec import ModelSpec
from tessel.planner.network import NONE, Cost
from tessel.planner.pricing import MEMORY_TERMS, Chunk, ChunkComm, Pricer, Stage, StepTerms
from tessel.planner.pricing.base import GROUP_AXES, ORDER, Pricing
from tessel.planner.pricing.context import ContextPricer
from tessel.planner.pricing.data import DataPricer
from tessel.planner.pricing.expert import ExpertPricer
from tessel.planner.pricing.pipeline import PipelinePricer, chunk_layers, peak_chunks_in_flight
from tessel.planner.pricing.recompute import RecomputePricer
from tessel.planner.pricing.tensor import TensorPricer
from tessel.planner.pricing.tensor_nd import GridPricer
from tessel.planner.pricing.trainer import TrainerPricer
from tessel.planner.pricing.zero import ZeroPricer
from tessel.planner.schedule import device_chunks
from tessel.planner.traffic import Call, merged, pp_calls, times, trainer_calls


# ---- alpha-beta collectives (Thakur et al. 2005; NCCL's bus-bandwidth factors) ----

def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(n-1) steps of nbytes/n each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.rate + 2 * (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of an nbytes result: n-1 steps of nbytes/n."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.rate + (n - 1) * link.latency


reduce_scatter_time = all_gather_time


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of its nbytes and sends the rest, one message per peer."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.rate + (n - 1) * link.latency


def p2p_time(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.rate


def chain_time(nbytes: float, n: int, link: Link) -> float:
    """Pipelined chain broadcast (or reduce): the whole buffer crosses each link, n-1 hops of latency."""
    if n <= 1:
        return 0.0
    return nbytes / link.rate + (n - 1) * link.latency


FORMULAS = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time,
            "all_to_all": all_to_all_time, "p2p": lambda nbytes, n, link: p2p_time(nbytes, link),
            "broadcast": chain_time, "reduce": chain_time}


@dataclass
class Estimate:
    layout: Layout
    step_s: float
    tokens_per_s: float
    model_flops_per_device: float  # achieved model FLOP/s per device (no recomputation counted)
    mfu: float
    memory: dict[str, float]  # bytes per device, worst stage: params, grads, optimizer, activations, ...
    time: dict[str, float]  # seconds per step on the critical path, by cause
    comm_bytes: dict[str, float]  # bytes each device sends per step, by axis
    bubble: float
    fits: bool
    chunk_times: list[list[tuple[float, float]]] = field(default_factory=list)  # [stage][chunk] = (fwd, bwd)
    p2p_s: float = 0.0
    dp_comm_s: float = 0.0
    stage_memory: dict[int, dict[str, float]] = field(default_factory=dict)  # stages 0 and pp-1 (all if v>1)
    placement: dict[str, str] = field(default_factory=dict)  # axis -> "intra" / "inter" node link
    hardware_flops_per_device: float = 0.0  # ... with the recomputed forwards counted (what the GPU runs)
    links: dict[str, float] = field(default_factory=dict)  # seconds each link of a device is busy per step
    path_s: float = 0.0  # the critical path alone (compute, exposed communication, bubble, optimizer)
    flush_s: float = 0.0  # one pipeline flush (m micro-batches through every stage)
    link_bound_s: float = 0.0  # the busiest link's seconds plus what no communication overlaps
    priced_by: str = "formula"  # how the flush was priced: "formula" (pipeline_time) or "simulator"
    # seconds of dp x ep traffic the network model prices: per micro-batch (ZeRO-2/3 without a
    # pipeline) and per step (buckets, or the pipeline's one reduce-scatter and gather); the
    # simulator replays these on the same links
    dp_mb_s: float = 0.0  # reduce-scatters
    dp_step_s: float = 0.0
    dp_gather_mb_s: float = 0.0  # ZeRO-3's gathers, per micro-batch

    @property
    def memory_total(self) -> float:
        return self.memory["total"]

    def repriced(self, flush_s: float, by: str = "simulator") -> Estimate:
        """This estimate with one pipeline flush taking `flush_s` (the event simulator's replay of the
        runtime's schedule, tessel.planner.search.simulate_top): the critical path moves by grad_accum
        times the difference, the link bound stays, and every rate follows the new step."""
        delta = self.layout.grad_accum * (flush_s - self.flush_s)
        path = self.path_s + delta
        step = max(path, self.link_bound_s)
        scale = self.step_s / step
        busy = (1 - self.bubble) * self.flush_s  # the busiest stage's compute in one flush
        time = {**self.time, "bubble": self.time["bubble"] + delta, "link-bound wait": step - path}
        return replace(self, step_s=step, tokens_per_s=self.tokens_per_s * scale,
                       model_flops_per_device=self.model_flops_per_device * scale, mfu=self.mfu * scale,
                       hardware_flops_per_device=self.hardware_flops_per_device * scale, time=time,
                       bubble=1 - busy / flush_s if flush_s > 0 else 0.0, path_s=path, flush_s=flush_s,
                       priced_by=by)

    def days_to_train(self, tokens: float) -> float:
        return tokens / self.tokens_per_s / 86400

    def to_json(self) -> dict:
        mib = {k: v / 2**20 for k, v in self.memory.items()}
        return {"layout": self.layout.to_dict(), "describe": self.layout.describe(),
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "model_flops_per_device": self.model_flops_per_device, "mfu": self.mfu,
                "hardware_flops_per_device": self.hardware_flops_per_device,
                "memory_mib": mib, "time_s": self.time, "comm_bytes": self.comm_bytes, "link_busy_s": self.links,
                "bubble": self.bubble, "fits": self.fits, "placement": self.placement, "priced_by": self.priced_by}


class CostModel(Pricing):
    """Prices layouts of one model on one cluster at one global batch, composing the strategies' pricers."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, precision: str = "bf16",
                 calibration: Calibration | None = None, bucket_mb: float = 25.0, reduce_dtype: str | None = None,
                 compiled: bool = False, fused_loss: bool = False):
        super().__init__(spec, cluster, precision, calibration, bucket_mb, reduce_dtype, compiled, fused_loss)
        self.data, self.zero, self.pipeline = DataPricer(self), ZeroPricer(self), PipelinePricer(self)
        self.tensor, self.grid, self.expert = TensorPricer(self), GridPricer(self), ExpertPricer(self)
        self.context, self.trainer = ContextPricer(self), TrainerPricer(self)
        self.recompute = RecomputePricer(self, self.tensor, self.grid, self.context)
        # the order a chunk's collectives and a step's terms are added in (floats: the order is the number)
        self.pricers: tuple[Pricer, ...] = (self.tensor, self.grid, self.expert, self.context, self.recompute,
                                            self.pipeline, self.data, self.zero, self.trainer)
        # every layer alike (a dense model, or MoE in every block): a chunk's price depends on its length, not on
        # which layers it holds, so the search's layouts reuse it (tessel plan's 175B search asks 280,000 times)
        layers = list(zip(self.moe_flags, self.layer_flops, map(tuple, self.layer_params)))
        self._alike = len(set(layers)) <= 1
        self._chunk_memo: dict = {}

    # -- one chunk, one stage ------------------------------------------------------------
    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm:
        """Every pricer's collectives of one chunk for one micro-batch, summed (the "cp comm" part apart:
        chunk_comm_parts)."""
        return combined(self.chunk_comm_parts(layout, chunk))

    def chunk_comm_parts(self, layout: Layout, chunk: Chunk) -> list[ChunkComm]:
        return [t for p in self.pricers if (t := p.chunk_comm(layout, chunk)) is not None]

    def stage(self, layout: Layout, index: int, all_chunks: list[list[int]], tokens: int) -> Stage:
        """Pipeline rank `index` of the layout: its chunks, its parameters, its micro-batches in flight."""
        chunks = device_chunks(layout.schedule, layout.pp, layout.virtual_stages, index)
        dense, expert = self.stage_params(layout, chunks, all_chunks)
        in_flight = peak_chunks_in_flight(layout.schedule, layout.pp, layout.micro_batches, index, layout.virtual_stages)
        return Stage(index, tuple(chunks), tuple(map(tuple, all_chunks)), tokens, dense, expert, in_flight)

    def stage_memory(self, layout: Layout, stage: int) -> dict[str, float]:
        """Bytes on pipeline rank `stage` (estimate() keeps the first and last stage's, or all when v > 1)."""
        all_chunks = chunk_layers(self.spec.cfg.n_layer, layout.pp, layout.virtual_stages)
        tokens = local_tokens(layout.micro_batch * self.spec.seq_len, layout.cp)
        return self.memory(layout, self.stage(layout, stage, all_chunks, tokens))

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        """Every pricer's memory terms on one stage's rank, in MEMORY_TERMS' order, and their total."""
        terms: dict[str, float] = {"baseline": self.cluster.baseline_memory}
        for p in self.pricers:
            terms.update(p.memory(layout, stage))
        mem = {k: terms[k] for k in MEMORY_TERMS if k in terms}
        mem["total"] = sum(mem.values())
        return mem

    # -- the whole step ----------------------------------------------------------------
    def estimate(self, layout: Layout) -> Estimate:
        """The step under `layout`: the stages walked, the pricers' step terms (the flush over the stages among
        them) added."""
        tokens = local_tokens(layout.micro_batch * self.spec.seq_len, layout.cp)  # one rank's share of a micro-batch
        all_chunks = chunk_layers(self.spec.cfg.n_layer, layout.pp, layout.virtual_stages)
        message = self.pipeline.message(layout)
        walk = self._walk(layout, all_chunks, tokens, message)
        chunk_times, stage_busy, mems = walk.chunk_times, walk.stage_busy, walk.memory
        memory = max(mems.values(), key=lambda mm: mm["total"])
        steps = [t for p in self.pricers if (t := p.step(layout, chunk_times, memory)) is not None]
        t_pipe, book = sum(t.flush_s for t in steps), sum(t.overhead_s for t in steps)
        compute_busy = max(stage_busy) * layout.micro_batches
        busy = walk.busy
        for t in steps:
            busy = busy + t.links
        fixed = sum(t.fixed_s for t in steps) + self.cal.step_overhead_s  # no communication overlaps these
        path = layout.grad_accum * t_pipe + sum(t.exposed_s for t in steps) + fixed + book
        # links are shared: everything a device sends or receives queues on its NVLink and its NIC
        link_bound = max(busy.nvlink_s, busy.nic_s) + fixed
        t_step = max(path, link_bound)
        sent = {**walk.sent, "pp": 2 * self.pipeline.message_bytes(layout) * layout.chunks * layout.virtual_stages
                if layout.pp > 1 else 0.0}
        for t in steps:
            sent.update(t.sent)
        sent.setdefault("dp", 0.0)
        dp = {k: sum(t.extra.get(k, 0.0) for t in steps) for k in ("total_s", "mb_s", "step_s", "gather_mb_s")}
        time = self._time_terms(layout, walk, t_pipe, compute_busy, message.seconds, steps, book, t_step - path)
        return self._estimate(layout, t_step, memory, time, sent, 1 - compute_busy / t_pipe if t_pipe > 0 else 0.0,
                              walk, message.seconds, dp, busy, path, t_pipe, link_bound)

    def _walk(self, layout: Layout, all_chunks: list[list[int]], tokens: int, message: Cost) -> Walk:
        """Every stage's chunks: their (forward, backward) seconds, the links each stage holds (the busiest
        kept), the memory of the first and last stage (every stage's when v > 1), and stage 0's seconds and
        bytes of communication inside its chunks."""
        walk = Walk()
        for s in range(layout.pp):
            chunks = device_chunks(layout.schedule, layout.pp, layout.virtual_stages, s)
            row, held = [], NONE
            for k in chunks:
                chunk = Chunk(tuple(all_chunks[k]), k == 0, k == len(all_chunks) - 1, tokens)
                f, b, rc, comm, cp_f, cp_b = self._chunk(layout, chunk)
                row.append((f + comm.fwd_s, b + rc + comm.bwd_s))
                held = held + comm.links[0].times(layout.chunks)
                if s == 0:
                    walk.add(layout.chunks, comm, cp_f, cp_b, rc)
            held = held + self.pipeline.stage_links(layout, chunks, len(all_chunks), message)
            walk.busy = max(walk.busy, held, key=lambda x: max(x.nvlink_s, x.nic_s))
            walk.chunk_times.append(row)
            walk.stage_busy.append(sum(f + b for f, b in row))
            if s in (0, layout.pp - 1) or layout.virtual_stages > 1:
                walk.memory[s] = self.memory(layout, self.stage(layout, s, all_chunks, tokens))
        return walk

    def _chunk(self, layout: Layout, chunk: Chunk) -> tuple[float, float, float, ChunkComm, float, float]:
        """(forward, backward, recompute) compute seconds of one chunk for one micro-batch, its collectives
        summed, and their context-parallel part (forward, backward)."""
        if not self._alike:
            return self._price_chunk(layout, chunk)
        key = (layout, len(chunk.layers), chunk.first, chunk.last, chunk.tokens)
        if key not in self._chunk_memo:
            self._chunk_memo[key] = self._price_chunk(layout, chunk)
        return self._chunk_memo[key]

    def _price_chunk(self, layout: Layout, chunk: Chunk) -> tuple[float, float, float, ChunkComm, float, float]:
        f, b, blocks, cores = self.chunk_compute(layout, chunk)
        parts = self.chunk_comm_parts(layout, chunk)
        cp_f = sum(t.fwd_s for t in parts if t.time_key == "cp comm")
        cp_b = sum(t.bwd_s for t in parts if t.time_key == "cp comm")
        return f, b, self.recompute.seconds(layout, blocks, cores), combined(parts), cp_f, cp_b

    def _time_terms(self, layout: Layout, walk: Walk, t_pipe: float, compute_busy: float, message_s: float,
                    steps: list[StepTerms], book: float, wait: float) -> dict[str, float]:
        """Seconds of the step on the critical path, by cause."""
        ga = layout.grad_accum
        messages = 2 * (layout.pp * layout.virtual_stages - 1) * message_s * ga if layout.pp > 1 else 0.0
        busy_compute = max(walk.stage_busy) * layout.micro_batches * ga
        return {"compute": busy_compute - walk.t_tp_ep - walk.t_rc - walk.t_cp,
                "recompute": walk.t_rc, "tp+ep comm": walk.t_tp_ep, "cp comm": walk.t_cp,
                "pp comm": messages, "bubble": ga * (t_pipe - compute_busy) - messages,
                "dp comm (exposed)": sum(t.exposed_s for t in steps), "optimizer": sum(t.fixed_s for t in steps),
                "overhead": self.cal.step_overhead_s + book, "link-bound wait": wait}

    def _estimate(self, layout: Layout, t_step: float, memory, time, sent, bubble: float, walk: Walk,
                  message_s: float, dp: dict[str, float], busy: Cost, path: float, t_pipe: float,
                  link_bound: float) -> Estimate:
        global_tokens = layout.global_batch * self.spec.seq_len
        model_flops = self.model_flops_tok * global_tokens / t_step / layout.world
        recomputed = self.model_flops_tok + self.recompute.flops_per_token(layout)
        hw_flops = recomputed * global_tokens / t_step / layout.world
        peak = self.cluster.peak_flops[compute_dtype(self.precision)]
        fits = memory["total"] <= self.cluster.memory * self.cluster.usable_memory
        geo = self.groups(layout)
        sizes = layout.axis_sizes
        placement = {a: ("intra" if geo[a].nodes == 1 else "inter") for a in ("tp", "pp", "dp", "ep", "cp")
                     if sizes[a] > 1}
        return Estimate(layout, t_step, global_tokens / t_step, model_flops, model_flops / peak, memory, time,
                        sent, bubble, fits, walk.chunk_times, message_s, dp["total_s"], walk.memory, placement,
                        hw_flops, {"nvlink": busy.nvlink_s, "nic": busy.nic_s}, path, t_pipe, link_bound,
                        "formula", dp["mb_s"], dp["step_s"], dp["gather_mb_s"])

    # -- every call of a step, for the tests that record a real one --------------------------
    def step_calls(self, layout: Layout, stage: int = 0) -> dict[str, list[Call]]:
        """Every collective and message one rank of pipeline stage `stage` issues in one optimizer
        step, by the group it runs on ("tp", "ep", "pp", "dp": dp x ep, "tied", "world"): the
        lists the estimate prices, whole (tests/planner/test_traffic_matches_runtime.py compares
        them with a real step's)."""
        tokens = local_tokens(layout.micro_batch * self.spec.seq_len, layout.cp)
        all_chunks = chunk_layers(self.spec.cfg.n_layer, layout.pp, layout.virtual_stages)
        mine = [stage + j * layout.pp for j in range(layout.virtual_stages)]
        out: dict[str, list[Call]] = collections.defaultdict(list)
        for k in mine:
            chunk = Chunk(tuple(all_chunks[k]), k == 0, k == len(all_chunks) - 1, tokens)
            for group, calls in self._chunk_calls(layout, chunk).items():
                out[group] += calls
        if layout.pp > 1:
            out["pp"] += pp_calls(self.pipeline.message_bytes(layout), mine, len(all_chunks), layout.chunks)
        if layout.token_shards > 1:
            dense, expert = self.stage_params(layout, mine, all_chunks)
            per_mb, per_step = self.data.calls(layout, 4 * (dense + expert), mine, all_chunks)
            out["dp"] += times(per_mb, layout.chunks) + per_step
        for calls in (self.trainer.calls(layout, stage), trainer_calls(layout.world, layout.token_shards)):
            for group, more in calls.items():
                out[group] += more
        return {group: merged(calls) for group, calls in out.items() if calls}

    def _chunk_calls(self, layout: Layout, chunk: Chunk) -> dict[str, list[Call]]:
        """One chunk's calls of a step by group: a grid's on "tp.0", "tp.1", ... (grid dims, outermost first)."""
        out: dict[str, list[Call]] = collections.defaultdict(list)
        n_moe = sum(self.moe_flags[i] for i in chunk.layers)
        full = layout.recompute == "full"
        grid = grid_cost.layout_grid(layout)
        if grid is not None:
            f, b = self.grid.calls(grid, len(chunk.layers), chunk.first, chunk.last, layout, chunk.tokens)
            for dim, c in f + b:
                out[f"tp.{dim}"] += times([c], layout.chunks)
        elif layout.tp > 1:
            f, b = self.tensor.calls(len(chunk.layers) - n_moe, n_moe, chunk.tokens, layout.sequence_parallel, full, chunk.first,
                                     chunk.last)
            out["tp"] += times(f + b, layout.chunks)
        if n_moe and layout.ep > 1:
            f, b = self.expert.calls(n_moe, chunk.tokens, full, layout.ep)
            out["ep"] += times(f + b, layout.chunks)
        if layout.cp > 1:
            f, b = self.context.calls(layout, chunk.tokens)
            out["cp"] += times(f + b, layout.chunks * len(chunk.layers))
        return out

    # -- what tests, the simulator and benchmarks ask -------------------------------------
    def links(self, layout: Layout) -> dict[str, Link]:
        sizes = layout.axis_sizes
        return {name: link_for(self.cluster, sizes, ORDER, axes) for name, axes in GROUP_AXES.items()}

    def message_link(self, link: Link) -> Link:
        """The link the simulator moves pipeline messages over: the probe's p2p fit on this machine's node
        (the same seconds the formula prices them at), the link itself elsewhere."""
        fit = self.fit("p2p", 2)
        if fit and link is self.cluster.intra:
            return Link(1 / fit[1] if fit[1] > 0 else float("inf"), fit[0])
        return link

    def coll(self, op: str, nbytes: float, n: int, link: Link) -> float:
        """Seconds of one collective: the probe's fit for (op, n) on this machine's one node,
        the alpha-beta formula of the link otherwise."""
        if n <= 1:
            return 0.0
        fit = self.fit(op, n)
        if fit and link is self.cluster.intra:
            return fit[0] + fit[1] * nbytes
        return FORMULAS[op](nbytes, n, link)

    def price(self, calls: list[Call], n: int, link: Link) -> float:
        return sum(c.count * self.coll(c.op, c.nbytes, n, link) for c in calls)

    def gemms(self, layout: Layout) -> list[Gemm]:
        """The distinct GEMMs of a dense block and the head on one tp rank of a 1d layout, forward and backward."""
        tokens = local_tokens(layout.micro_batch * self.spec.seq_len, layout.cp)
        return step_gemms(self.shape(layout, tokens, False), math.ceil(self.spec.cfg.vocab_size / layout.tp))


@dataclass
class Walk:
    """What the estimate gathers walking the stages: per-chunk seconds, per-stage totals, the busiest stage's
    links, memory by stage, and stage 0's communication (seconds by cause, bytes by axis)."""
    chunk_times: list[list[tuple[float, float]]] = field(default_factory=list)
    stage_busy: list[float] = field(default_factory=list)
    busy: Cost = NONE
    memory: dict[int, dict[str, float]] = field(default_factory=dict)
    sent: dict[str, float] = field(default_factory=lambda: {"tp": 0.0, "ep": 0.0, "cp": 0.0})
    t_tp_ep: float = 0.0
    t_cp: float = 0.0
    t_rc: float = 0.0

    def add(self, n: int, comm: ChunkComm, cp_f: float, cp_b: float, rc: float) -> None:
        """One of stage 0's chunks, run n times a step."""
        self.t_tp_ep += (comm.fwd_s + comm.bwd_s - cp_f - cp_b) * n
        self.t_cp += (cp_f + cp_b) * n
        self.t_rc += rc * n
        for key in self.sent:
            self.sent[key] += comm.sent.get(key, 0.0) * n


def combined(parts: list[ChunkComm]) -> ChunkComm:
    """Pricers' collectives of one chunk as one: seconds and bytes summed, links added in order."""
    fwd = bwd = 0.0
    links, sent = NONE, {}
    for t in parts:
        fwd, bwd = fwd + t.fwd_s, bwd + t.bwd_s
        for c in t.links:
            links = links + c
        sent.update(t.sent)
    return ChunkComm(fwd, bwd, sent, (links,), "all")
