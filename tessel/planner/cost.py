"""The cost model: FLOPs, memory and communication of one training step under a layout.

Everything is per device and per optimizer step, for tessel's reference GPT.
Sources of each formula are cited where they are used; the hand-checkable
pieces (collective times, activation bytes, in-flight micro-batches, ZeRO
shards) are small functions with unit tests in tests/planner/test_cost.py.

Compute: on "this" machine, the profile's measured speed of the whole model
(tessel.calibrate.profile); on a GPU preset, a roofline per op of every block
(tessel.planner.compute); on a cluster without either, a flat fraction of the
peak.

Communication is priced call by call: tessel.planner.traffic lists the
collectives tessel's layers, data-parallel wrappers and pipeline issue, and
each call costs the probe's measured fit for its op and group size on "this"
machine, or the network model (tessel.planner.network: NVLink rings, rails,
SHARP, PXN) on a preset cluster.

Links are shared: every collective and message also holds its device's NVLink
or NIC for a while, and a step is never shorter than its busiest link's total
(nor than its compute), however much of that traffic overlaps compute.

Context parallelism (cp) divides every rank's tokens by cp and adds its ring
or Ulysses traffic per block (tessel.planner.context).

Placement: ranks are ordered pp > dp > ep > cp > tp (tp innermost), as tessel.mesh
lays them out; a group's geometry (members per node, nodes) says which links
it uses (tessel.planner.cluster.group_geometry).
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field, replace

from tessel.axes import AXES
from tessel.planner.cluster import Cluster, Geometry, Link, group_geometry, link_for
from tessel.planner import grid_cost
from tessel.planner.compute import Shape, block_seconds, edge_seconds, step_gemms
from tessel.planner.gemm import Gemm
from tessel.planner.context import (cp_block_calls, local_tokens, mlp_half_bytes, ring_backward_bytes,
                                    ring_exposed, ring_kv_saving)
from tessel.planner.layout import Layout
from tessel.planner.memory import (attention_core_bytes, head_activation_bytes, layer_activation_bytes,
                                   recompute_layer_bytes, unfused_attention_bytes, zero_state_bytes)
from tessel.planner.model_spec import ModelSpec
from tessel.planner.schedule import (NEW_SCHEDULES, captured_gradient_bytes, device_chunks, flush_time,
                                     held_bytes, held_micro_batches, stashed_versions)
from tessel.planner.network import NONE, Cost, collective
from tessel.planner.traffic import (Call, bookkeeping_calls, dp_step_calls, ep_chunk_calls, merged, pp_calls,
                                    times, tp_chunk_calls, trainer_calls)

ORDER = AXES  # tessel.mesh lays ranks out in this order by default
ADAM_BYTES_TOUCHED = 28  # per parameter: read+write fp32 weight, m, v (24) + read the gradient (4)
CLIP_BYTES = 12  # per parameter of the gradient shard: the norm reads it, the clip scales it in place
PUBLISH_BYTES = 6  # bf16 storage: each updated fp32 master written back as bf16 (read 4, write 2)


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


def sent_bytes(calls: list[Call], n: int) -> float:
    """Bytes one rank sends for `calls` in a group of n (ring algorithms; all-reduce sends twice)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}
    return sum(c.count * c.nbytes * factor.get(c.op, (n - 1) / n) for c in calls)

@dataclass
class Calibration:
    """Measured on this machine by tessel.calibrate.profile.profile_model; None fields fall back to the cluster."""
    # (tokens per micro-batch, achieved FLOP/s of a full forward+backward at that size)
    flops_points: list[tuple[int, float]] = field(default_factory=list)
    opt_s_per_param: float | None = None  # clip + AdamW step, seconds per parameter on this rank
    step_overhead_s: float = 0.0  # data, loss all-reduce, Python: per step, independent of the model
    # tp degree -> the same points for the model as one tp rank computes it (without its
    # collectives), in whole-model FLOPs per second: smaller matrices run less efficiently
    tp_points: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # tp degree -> (tokens per micro-batch, seconds its tp collectives added to a whole-model
    # forward+backward when issued between the matmuls, as the trainer issues them)
    tp_comm: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def achieved(self, tokens: int, fallback: float, tp: int = 1) -> float:
        """Whole-model FLOP/s of one rank at a micro-batch of `tokens` under `tp`, log-linear
        between measured sizes, flat outside.

        Without a profile of that tp degree, a tp-sharded matmul is priced like
        an unsharded one on tokens/tp rows (the same work per call), tp times faster.
        """
        if tp in self.tp_points:
            return _interpolate(self.tp_points[tp], tokens, fallback)
        if tp == 1:
            return _interpolate(self.flops_points, tokens, fallback)
        return tp * _interpolate(self.tp_points.get(1, self.flops_points), max(1, tokens // tp), fallback / tp)


def _interpolate(points: list[tuple[int, float]], tokens: int, fallback: float) -> float:
    pts = sorted(points)
    if not pts:
        return fallback
    xs = [t for t, _ in pts]
    if tokens <= xs[0]:
        return pts[0][1]
    if tokens >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(xs, tokens)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp((1 - w) * math.log(y0) + w * math.log(y1))


# ---- how layers fall onto stages ----------------------------------------------

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


class CostModel:
    """Prices layouts of one model on one cluster at one global batch."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, precision: str = "bf16",
                 calibration: Calibration | None = None, bucket_mb: float = 25.0, reduce_dtype: str | None = None,
                 compiled: bool = False, fused_loss: bool = False):
        self.spec, self.cluster, self.precision = spec, cluster, precision
        # train.compile != "off" and train.fused_loss: priced by the roofline (tessel.planner.compute) and,
        # for the loss, in memory; a measured profile ("this") times the model as it was profiled
        self.compiled, self.fused_loss = compiled, fused_loss
        self.cal = calibration or Calibration()
        self.bucket_bytes = bucket_mb * 2**20
        self.reduce_dtype = reduce_dtype  # parallel.zero_reduce_dtype; None: the layout's param_dtype
        L = spec.cfg.n_layer
        # tessel's experts compute only the rows they keep (tessel.models.moe.Experts), not a
        # buffer padded to the capacity; the profile converts its times with the same count
        self.layer_flops = [spec.layer_fwd_flops_per_token(i) for i in range(L)]
        self.layer_params = [spec.layer_params(i) for i in range(L)]
        self.act_bytes = 2 if precision == "bf16" else 4
        self.moe_flags = [spec.is_moe(i) for i in range(L)]
        self.model_flops_tok = spec.model_flops_per_token()
        # the per-op device model prices compute where nothing was measured and the cluster has one
        self.roofline = cluster.sms > 0 and not (self.cal.flops_points or self.cal.tp_points)
        self._comm_memo: dict = {}
        self._block_memo: dict = {}

    # -- compute ---------------------------------------------------------------
    def flops_per_s(self, tokens: int, tp: int = 1) -> float:
        """Whole-model FLOP/s one rank achieves on micro-batches of `tokens` under `tp`."""
        return self.cal.achieved(tokens, self.cluster.flops(self.precision) * tp, tp)

    def attention_core_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block's attention core for `tokens` (scores and weighted sum, the whole
        square as tessel counts them): what selective recompute runs again."""
        return 4 * self.spec.seq_len * self.spec.attention.heads * self.spec.head_dim * tokens

    def _chunk_compute(self, layers: list[int], last: bool, lay: Layout, tokens: int,
                       first: bool = False) -> tuple[float, float, float]:
        """(forward, backward, recompute) seconds of one chunk for one micro-batch on one tp rank."""
        if self.roofline:
            return self._chunk_roofline(layers, first, last, lay, tokens)
        fwd_flops = sum(self.layer_flops[i] for i in layers) * tokens
        head = self.spec.head_fwd_flops_per_token * tokens if last else 0.0
        # measured on the tp-sharded shapes where profiled (small matrices run less efficiently)
        speed = self.flops_per_s(tokens, lay.tp)
        f, h = fwd_flops / speed, head / speed
        rc = {"none": 0.0, "full": f, "selective": len(layers) * self.attention_core_flops(tokens) / speed}
        return f + h, 2 * (f + h), rc[lay.recompute]

    def _chunk_roofline(self, layers: list[int], first: bool, last: bool, lay: Layout,
                        tokens: int) -> tuple[float, float, float]:
        if lay.tp_mode != "1d" and lay.tp > 1:
            return self._grid_chunk_roofline(layers, first, last, lay, tokens)
        f = b = core = 0.0
        for i in layers:
            bf, bb, bc = self._block(self._shape(lay, tokens, self.moe_flags[i]))
            f, b, core = f + bf, b + bb, core + bc
        rc = {"none": 0.0, "full": f, "selective": core}[lay.recompute]
        if first or last:
            vocab = math.ceil(self.spec.cfg.vocab_size / lay.tp)
            ef, eb = edge_seconds(self._shape(lay, tokens, False), vocab, self.cluster, self._dtype(), first, last)
            f, b = f + ef, b + eb
        return f, b, rc

    def _grid_chunk_roofline(self, layers: list[int], first: bool, last: bool, lay: Layout,
                             tokens: int) -> tuple[float, float, float]:
        """_chunk_roofline on a 2D / 2.5D / 3D grid (tessel.planner.grid_cost: the rank's shapes, its GEMMs
        in the grid's steps)."""
        grid = grid_cost.layout_grid(lay)
        key = (grid, tokens, self._param_bytes(lay), first, last)
        if key not in self._block_memo:  # (block, edges) seconds: thousands of layouts share a few
            whole = replace(lay, tp=1, sequence_parallel=False, tp_mode="1d")
            shape = grid_cost.rank_shape(grid, self._shape(whole, tokens, False))
            edges = grid_cost.edge_seconds(shape, grid, self.spec.cfg.vocab_size, self.cluster, self._dtype(),
                                           first, last) if first or last else (0.0, 0.0)
            self._block_memo[key] = grid_cost.block_seconds(shape, grid, self.cluster, self._dtype()), edges
        (bf, bb, bc), (ef, eb) = self._block_memo[key]
        n = len(layers)
        rc = {"none": 0.0, "full": n * bf, "selective": n * bc}[lay.recompute]
        return n * bf + ef, n * bb + eb, rc

    def _dtype(self) -> str:
        return "bf16" if self.precision == "bf16" else "fp32"

    def gemms(self, lay: Layout) -> list[Gemm]:
        """The distinct GEMMs of a dense block and the head on one tp rank of a 1d layout, forward and backward."""
        tokens = local_tokens(lay.micro_batch * self.spec.seq_len, lay.cp)
        return step_gemms(self._shape(lay, tokens, False), math.ceil(self.spec.cfg.vocab_size / lay.tp))

    def _block(self, shape: Shape) -> tuple[float, float, float]:
        if shape not in self._block_memo:  # thousands of layouts share a few block shapes
            self._block_memo[shape] = block_seconds(shape, self.cluster, self._dtype())
        return self._block_memo[shape]

    def _shape(self, lay: Layout, tokens: int, moe: bool) -> Shape:
        spec, c = self.spec, self.spec.cfg
        bf16_storage = self._param_bytes(lay) == 2
        act = self.act_bytes
        local_experts = spec.n_experts // lay.ep if moe else 0
        latent = spec.attention.gemms(lay.tp) if spec.attention.latent else ()  # its own projections
        return Shape(tokens=tokens, seq=spec.seq_len, d_model=c.d_model, heads=c.n_head // lay.tp,
                     kv_heads=max(1, c.kv_heads // lay.tp), head_dim=spec.head_dim,
                     ffn=spec.expert_ffn if moe else c.ffn_dim // lay.tp, mlp_matrices=spec.mlp_matrices,
                     sp_tokens=tokens // lay.tp if lay.sequence_parallel else tokens, act=act,
                     resid=2 if act == 2 and bf16_storage else 4,  # fp32 weights keep the residual fp32
                     cast=act == 2 and not bf16_storage, fused=self.cluster.fused_attention,
                     experts=local_experts, cp=lay.cp,
                     expert_rows=max(1, round(tokens * lay.ep * spec.moe_top_k / spec.n_experts)) if moe else 0,
                     router=spec.n_experts if moe else 0, compiled=self.compiled, fused_loss=self.fused_loss,
                     shared_ffn=spec.shared_ffn if moe else 0, attn_gemms=latent)

    # -- communication -----------------------------------------------------------
    def links(self, lay: Layout) -> dict[str, Link]:
        sizes = lay.axis_sizes
        return {name: link_for(self.cluster, sizes, ORDER, axes) for name, axes in GROUP_AXES.items()}

    def groups(self, lay: Layout) -> dict[str, Geometry]:
        """How each of the layout's groups lies on the nodes (tp innermost)."""
        sizes = lay.axis_sizes
        return {name: group_geometry(sizes, ORDER, axes, self.cluster.devices_per_node)
                for name, axes in GROUP_AXES.items()}

    def _fit(self, op: str, n: int) -> list[float] | None:
        """The probe's alpha-beta fit for (op, n) on this machine. A p2p message is priced as it was
        measured while the other ranks computed (tessel.calibrate.profile._p2p_under_load), which is how a
        pipeline's and a ring's messages travel; a probe without that measurement gives the idle fit."""
        fits = self.cluster.collectives
        if op == "p2p":
            return fits.get("p2p_loaded/2") or fits.get("p2p/2")
        return fits.get(f"{op}/{n}")

    def message_link(self, link: Link) -> Link:
        """The link the simulator moves pipeline messages over: the probe's p2p fit on this machine's node
        (the same seconds the formula prices them at), the link itself elsewhere."""
        fit = self._fit("p2p", 2)
        if fit and link is self.cluster.intra:
            return Link(1 / fit[1] if fit[1] > 0 else float("inf"), fit[0])
        return link

    def coll(self, op: str, nbytes: float, n: int, link: Link) -> float:
        """Seconds of one collective: the probe's fit for (op, n) on this machine's one node,
        the alpha-beta formula of the link otherwise."""
        if n <= 1:
            return 0.0
        fit = self._fit(op, n)
        if fit and link is self.cluster.intra:
            return fit[0] + fit[1] * nbytes
        return FORMULAS[op](nbytes, n, link)

    def price(self, calls: list[Call], n: int, link: Link) -> float:
        return sum(c.count * self.coll(c.op, c.nbytes, n, link) for c in calls)

    def cost(self, op: str, nbytes: float, geo: Geometry) -> Cost:
        """One collective over a group shaped `geo`, with the links it holds: the probe's fit on this
        machine's one node, the network model (tessel.planner.network) on a preset."""
        if geo.n <= 1:
            return NONE
        fit = self._fit(op, geo.n)
        if fit and geo.nodes == 1:
            return Cost(fit[0] + fit[1] * nbytes, fit[1] * nbytes, 0.0)
        return collective(op, nbytes, geo, self.cluster)

    def price_group(self, calls: list[Call], geo: Geometry) -> Cost:
        total = NONE
        for c in calls:
            total = total + self.cost(c.op, c.nbytes, geo).times(c.count)
        return total

    def _chunk_comm(self, layers: list[int], lay: Layout, tokens: int, links, first: bool,
                    last: bool) -> tuple[float, float, dict]:
        """(forward, backward) seconds of tp and ep collectives of one chunk for one micro-batch.

        The calls are those tessel's layers issue (tessel.planner.traffic);
        full recomputation repeats each block's forward collectives in backward.
        """
        fwd, bwd, sent, _ = self._chunk_comm_links(layers, lay, tokens, first, last)
        return fwd, bwd, sent

    def _chunk_comm_links(self, layers: list[int], lay: Layout, tokens: int, first: bool,
                          last: bool) -> tuple[float, float, dict, Cost]:
        """_chunk_comm and the links its collectives hold."""
        n_moe = sum(self.moe_flags[i] for i in layers)
        key = (len(layers) - n_moe, n_moe, first, last, lay.tp, lay.ep, lay.sequence_parallel, lay.recompute == "full",
               tokens, lay.dp, lay.pp, lay.tp_mode, lay.tp_depth)
        if key not in self._comm_memo:  # thousands of layouts share a few chunk shapes
            grid = grid_cost.layout_grid(lay)
            self._comm_memo[key] = (self._grid_chunk_comm(grid, len(layers), first, last, lay, tokens) if grid
                                    else self._chunk_comm_priced(*key[:9], self.groups(lay)))
        return self._comm_memo[key]

    def grid_groups(self, lay: Layout) -> dict[int, Geometry]:
        """{grid dim: how its groups lie on the nodes} of a 2D / 2.5D / 3D layout (tp innermost, the grid
        row-major inside the tp group)."""
        sizes = {a: getattr(lay, a) for a in ORDER}
        return grid_cost.grid_geometry(sizes, ORDER, grid_cost.layout_grid(lay), self.cluster.devices_per_node)

    def _grid_calls(self, grid, n_blocks: int, first: bool, last: bool, lay: Layout, tokens: int):
        """(forward, backward) (grid dim, call) lists of one chunk for one micro-batch (tessel.planner.grid_cost)."""
        resid = 2 if self.act_bytes == 2 and self._param_bytes(lay) == 2 else 4
        return grid_cost.chunk_calls(grid, self.spec, tokens, self.act_bytes, self._param_bytes(lay), resid, n_blocks,
                                     lay.recompute == "full", first, last)

    def _grid_chunk_comm(self, grid, n_blocks: int, first: bool, last: bool, lay: Layout,
                         tokens: int) -> tuple[float, float, dict, Cost]:
        """_chunk_comm_priced on a grid: each call priced on the groups of its grid dim."""
        fwd, bwd = self._grid_calls(grid, n_blocks, first, last, lay, tokens)
        geo = self.grid_groups(lay)

        def priced(calls) -> Cost:
            return sum((self.price_group(merged([c for d, c in calls if d == a]), geo[a]) for a in geo), NONE)
        tf, tb = priced(fwd), priced(bwd)
        sent = sum(sent_bytes([c], grid.dims[a]) for a, c in fwd + bwd)
        return tf.seconds, tb.seconds, {"tp": sent, "ep": 0.0}, tf + tb

    def _chunk_comm_priced(self, n_dense: int, n_moe: int, first: bool, last: bool, tp: int, ep: int, sp: bool,
                           recompute: bool, tokens: int, groups) -> tuple[float, float, dict, Cost]:
        tp_f, tp_b, ep_f, ep_b = [], [], [], []
        if tp > 1:
            tp_f, tp_b = self._tp_calls(n_dense, n_moe, tokens, sp, recompute, first, last)
        if n_moe and ep > 1:
            ep_f, ep_b = self._ep_calls(n_moe, tokens, recompute)
        k = self._tp_in_step_factor(tp, tokens, groups["tp"])
        tf, tb = self.price_group(tp_f, groups["tp"]), self.price_group(tp_b, groups["tp"])
        ef, eb = self.price_group(ep_f, groups["ep"]), self.price_group(ep_b, groups["ep"])
        fwd = k * tf.seconds + ef.seconds
        bwd = k * tb.seconds + eb.seconds
        sent = {"tp": sent_bytes(tp_f + tp_b, tp), "ep": sent_bytes(ep_f + ep_b, ep)}
        return fwd, bwd, sent, tf + tb + ef + eb

    def _tp_in_step_factor(self, tp: int, tokens: int, geo: Geometry) -> float:
        """Measured in-step cost of tp collectives over their idle alpha-beta price (1 unprofiled).

        The probe times collectives that every rank enters at once; between matmuls the ranks
        of a tp group arrive apart (shared cores, OS scheduling) and wait for each other. The
        profile measured the whole model's tp collectives in a real forward+backward at this
        tp degree: that over the price of the same calls is the factor for this machine.
        """
        points = self.cal.tp_comm.get(tp)
        if tp <= 1 or not points:
            return 1.0
        n_moe = sum(self.moe_flags)  # the profiled model: every block, both edges, no SP or recompute
        f, b = self._tp_calls(self.spec.cfg.n_layer - n_moe, n_moe, tokens, False, False, True, True)
        priced = self.price_group(f + b, geo).seconds
        measured = max(0.0, _interpolate(points, tokens, priced))
        return measured / priced if priced > 0 else 1.0

    def _tp_calls(self, n_dense: int, n_moe: int, tokens: int, sp: bool, recompute: bool, first: bool,
                  last: bool) -> tuple[list[Call], list[Call]]:
        """(forward, backward) tp collectives of a chunk of n_dense + n_moe blocks (+ its edges)."""
        c = self.spec.cfg
        return tp_chunk_calls(c.d_model, c.vocab_size, tokens, self.act_bytes, n_dense, n_moe, sp, recompute,
                              first, last)

    def _ep_calls(self, n_moe: int, tokens: int, recompute: bool) -> tuple[list[Call], list[Call]]:
        c = self.spec.cfg
        return ep_chunk_calls(c.d_model, tokens, self.act_bytes, self.spec.moe_top_k, c.capacity_factor,
                              self.spec.n_experts,
                              n_moe, recompute)

    def _p2p_bytes(self, lay: Layout) -> float:
        """One pipeline message: a micro-batch's activation (sequence-sharded under SP)."""
        split = lay.sequence_parallel or lay.tp_mode != "1d"  # a grid splits the activation over all of its ranks
        return (lay.micro_batch * self.spec.seq_len * self.spec.cfg.d_model * self.act_bytes / (lay.tp if split else 1)
                / lay.cp)

    # -- context parallelism (tessel.planner.context) ------------------------------------
    def _widths(self, lay: Layout) -> tuple[int, int]:
        """Query and key/value widths (heads x head_dim) on one tp rank."""
        c = self.spec.cfg
        return c.n_head // lay.tp * self.spec.head_dim, max(1, c.kv_heads // lay.tp) * self.spec.head_dim

    def _cp_calls(self, lay: Layout, tokens: int) -> tuple[list[Call], list[Call]]:
        """One block's cp calls for `tokens` local tokens; full recompute repeats the forward's in backward."""
        q, kv = self._widths(lay)
        f, b = cp_block_calls(lay.cp_mode, lay.cp, tokens, q, kv, self.act_bytes)
        return f, (b + f if lay.recompute == "full" else b)

    def _chunk_cp(self, layers: list[int], lay: Layout, tokens: int,
                  geo: Geometry) -> tuple[float, float, float, Cost]:
        """(forward, backward) exposed seconds, bytes sent and links of one chunk's cp calls for a micro-batch.
        The ring's hops hide behind the blocks of the attention core (forward's once, backward's twice its work)."""
        f, b = self._cp_calls(lay, tokens)
        fc, bc = self.price_group(f, geo), self.price_group(b, geo)
        n = len(layers)
        if lay.cp_mode == "ring":
            core = self._core_seconds(lay, tokens)
            # cp - 1 steps pass blocks while one computes; backward's last hop (the gradient home) waits
            fwd = ring_exposed(fc.seconds, lay.cp - 1, core, lay.cp) * n
            bwd = ring_exposed(bc.seconds, lay.cp - 1, 2 * core, lay.cp) * n
        else:
            fwd, bwd = fc.seconds * n, bc.seconds * n
        return fwd, bwd, sent_bytes(f + b, 2 if lay.cp_mode == "ring" else lay.cp) * n, (fc + bc).times(n)

    def _core_seconds(self, lay: Layout, tokens: int) -> float:
        """Forward seconds of one block's attention core on `tokens` local tokens."""
        if self.roofline:
            return self._block(self._shape(lay, tokens, False))[2]
        return self.attention_core_flops(tokens) / self.flops_per_s(tokens, lay.tp)

    def _ring_saving(self, lay: Layout, tokens: int) -> float:
        if lay.cp == 1 or lay.cp_mode != "ring":
            return 0.0
        q, kv = self._widths(lay)
        return ring_kv_saving(tokens, q, kv, 2 if self.precision == "bf16" else 4)

    def _ring_buffers(self, lay: Layout, tokens: int) -> float:
        """What the ring's backward adds to a block's: its buffers, less the MLP half's saved bytes already freed."""
        if lay.cp == 1 or lay.cp_mode != "ring":
            return 0.0
        q, kv = self._widths(lay)
        c = self.spec.cfg
        freed = mlp_half_bytes(tokens, c.d_model, c.ffn_dim, lay.tp, lay.sequence_parallel, self.precision)
        return max(0.0, ring_backward_bytes(tokens, q, kv, 2 if self.precision == "bf16" else 4) - freed)

    # -- memory ----------------------------------------------------------------------
    def _param_bytes(self, lay: Layout) -> int:
        """Bytes of a stored parameter: bf16 where ZeRO stores them so (the runtime allows it with ZeRO
        and without a pipeline, tessel.config), fp32 otherwise."""
        return 2 if lay.zero_param_dtype == "bf16" and lay.zero_stage >= 1 and lay.pp == 1 else 4

    def _reduce_bytes(self, lay: Layout) -> int:
        if self._param_bytes(lay) == 4 and self.reduce_dtype in (None, "fp32"):
            return 4
        return 2 if (self.reduce_dtype or lay.zero_param_dtype) == "bf16" and lay.zero_stage >= 1 and lay.pp == 1 else 4

    def _stage_params(self, chunks: list[int], lay: Layout, all_chunks: list[list[int]]) -> tuple[float, float]:
        """(dense, expert) parameters held by one device before ZeRO."""
        dense = expert = whole = 0.0
        for k in chunks:
            for i in all_chunks[k]:
                d, e = self.layer_params[i]
                dense += d
                expert += e
                whole += self.spec.layer_tp_whole_params(i)
        if 0 in chunks:
            dense += self.spec.embedding_params
        if len(all_chunks) - 1 in chunks:
            dense += self.spec.head_params
            if self.spec.cfg.tie_embeddings and 0 not in chunks:  # the last stage's copy of the tied embedding
                dense += self.spec.cfg.vocab_size * self.spec.cfg.d_model
        shards = grid_cost.weight_shards(lay)  # tp, or a grid's pieces (2.5D's depth layers hold copies)
        # routed experts are split over ep only: an MoE block runs whole on every tp rank (layer_tp_whole_params)
        return (dense - whole) / shards + whole, expert / lay.ep

    def state_memory(self, dense: float, expert: float, lay: Layout) -> dict[str, float]:
        """Parameters, gradients and optimizer state of one device (tessel.planner.memory.zero_state_bytes):
        dense parameters sharded over dp x ep (x cp), experts over dp (x cp)."""
        pb, rb = self._param_bytes(lay), self._reduce_bytes(lay)
        whole = lay.pp > 1  # gradients accumulate whole over the micro-batches, reduce-scattered after the flush
        d = zero_state_bytes(dense, lay.zero_stage, lay.token_shards, pb, rb, whole)
        e = zero_state_bytes(expert, lay.zero_stage, lay.dp * lay.cp, pb, rb, whole)
        return {k: d[k] + e[k] for k in d}

    def _memory(self, stage: int, chunks: list[int], lay: Layout, all_chunks, tokens: int) -> dict[str, float]:
        dense, expert = self._stage_params(chunks, lay, all_chunks)
        mem = self.state_memory(dense, expert, lay)
        grid = grid_cost.layout_grid(lay)
        if grid is not None:  # dense blocks only: every one keeps the same (cp > 1 is refused with a grid)
            per_layer = [grid_cost.layer_activation_bytes(self.spec, tokens, grid, self.precision)]
        else:
            per_layer = [layer_activation_bytes(self.spec, tokens, lay.tp, lay.sequence_parallel, self.precision,
                                                self.moe_flags[i])
                         - self._ring_saving(lay, tokens) for k in chunks for i in all_chunks[k]] or [0.0]
        one_layer, biggest = sum(per_layer) / len(per_layer), max(per_layer)  # mean over this device's blocks
        fused = self.cluster.fused_attention
        if not fused:  # the T x T probabilities of every head
            scores = unfused_attention_bytes(self.spec, tokens, lay.tp, self.precision)
            one_layer, biggest = one_layer + scores, biggest + scores
        in_flight = peak_chunks_in_flight(lay.schedule, lay.pp, lay.micro_batches, stage, lay.virtual_stages)
        layers_per_chunk = sum(len(all_chunks[k]) for k in chunks) / len(chunks)
        core = attention_core_bytes(self.spec, tokens, lay.tp, self.precision, fused)
        if lay.recompute == "full":
            kept = in_flight * layers_per_chunk * recompute_layer_bytes(self.spec, tokens, lay.tp,
                                                                        lay.sequence_parallel or grid is not None)
            kept += biggest  # one block rebuilt at a time
        elif lay.recompute == "selective":
            kept = in_flight * layers_per_chunk * (one_layer - core) + core  # one core rebuilt at a time
        else:
            kept = in_flight * layers_per_chunk * one_layer
        # backward of a block materialises gradients about as large as what it saved (the ring its blocks too);
        # the head's backward comes first, when no block's has begun: the peak is the larger of the two
        workspace = biggest + self._ring_buffers(lay, tokens)
        if len(all_chunks) - 1 in chunks:
            workspace = max(workspace, head_activation_bytes(self.spec, tokens, lay.tp, self.precision,
                                                             self.fused_loss))
        mem["activations"] = kept + workspace
        mem["weight_copies"] = self._weight_copies(lay, chunks, all_chunks, in_flight)
        if lay.schedule in NEW_SCHEDULES and lay.pp > 1:
            mem.update(self._split_and_stash(stage, chunks, lay, all_chunks, tokens, dense + expert))
        transient = 0.0
        pb = self._param_bytes(lay)
        if lay.zero_stage >= 3 and lay.pp > 1:  # under a pipeline the whole stage is gathered for the step
            transient = pb * (dense + expert)
        elif lay.zero_stage >= 3:  # the gathered weights of the block being computed and the prefetched next
            transient = 2 * pb / 4 * self._largest_block_bytes(grid_cost.weight_shards(lay))
        elif lay.zero_stage == 2:  # one bucket in flight, never more than the gradients it holds
            transient = min(self.bucket_bytes, self._reduce_bytes(lay) * (dense + expert))
        mem["buffers"] = transient + self._collective_workspace(lay, 4 * (dense + expert))
        mem["baseline"] = self.cluster.baseline_memory
        mem["total"] = sum(mem.values())
        return mem

    def _split_and_stash(self, stage: int, chunks: list[int], lay: Layout, all_chunks, tokens: int,
                         params: float) -> dict[str, float]:
        """A split backward's captured gradients, held from B to W (tessel.planner.schedule), and an
        asynchronous pipeline's stashed weight versions (fp32 copies of the stage's parameters)."""
        c = self.spec.cfg
        held = held_micro_batches(lay.schedule, lay.pp, lay.micro_batches, stage, lay.virtual_stages)[0]
        layers_per_chunk = sum(len(all_chunks[k]) for k in chunks) / len(chunks)
        one = captured_gradient_bytes(c.d_model, c.kv_heads * self.spec.head_dim, c.ffn_dim, tokens, lay.tp,
                                      self.act_bytes)
        if len(all_chunks) - 1 in chunks and not self.fused_loss:  # the head's: the logits' gradient (a fused
            # loss never holds it whole: its chunks' gradients are spent in the forward)
            one += tokens * c.vocab_size * self.act_bytes / lay.tp / layers_per_chunk
        # what the captured gradients add at the moment the stage holds most (not at their own peak)
        act = layers_per_chunk * self._mean_layer_bytes(chunks, all_chunks, lay, tokens)
        joint = held_bytes(lay.schedule, lay.pp, lay.micro_batches, stage, lay.virtual_stages, act,
                           layers_per_chunk * one)
        out = {"captured_grads": joint - held * act}
        versions = stashed_versions(lay.schedule, held)
        if versions:
            out["weight_versions"] = versions * 4 * params
        return out

    def _mean_layer_bytes(self, chunks: list[int], all_chunks, lay: Layout, tokens: int) -> float:
        per_layer = [layer_activation_bytes(self.spec, tokens, lay.tp, lay.sequence_parallel, self.precision,
                                            self.moe_flags[i])
                     for k in chunks for i in all_chunks[k]] or [0.0]
        return sum(per_layer) / len(per_layer)

    def _weight_copies(self, lay: Layout, chunks: list[int], all_chunks, in_flight: int) -> float:
        """bf16 copies of fp32 weights that autocast makes on each forward and autograd keeps until that
        micro-batch's backward: every in-flight chunk-forward holds its own (the cast cache lives for one
        autocast region). A fully recomputed block makes its copies inside the checkpoint: one block's."""
        if self.act_bytes != 2 or self._param_bytes(lay) == 2 or lay.tp_mode != "1d":
            return 0.0  # a grid multiplies the blocks it holds or gathers (grid_cost.layer_activation_bytes)
        matrices = [sum(self.layer_params[i]) / lay.tp for k in chunks for i in all_chunks[k]] or [0.0]
        if lay.recompute == "full":
            return 2 * max(matrices)
        return 2 * in_flight * sum(matrices) / len(chunks)

    def _largest_block_bytes(self, tp: int) -> float:  # tp: the pieces a weight is split into
        """fp32 bytes of the biggest block's parameters on one tp rank: what ZeRO-3 gathers at once."""
        return 4 * max(sum(p) for p in self.layer_params) / tp

    def _collective_workspace(self, lay: Layout, param_bytes: float) -> float:
        """Host memory the backend's data-parallel collectives add (gloo works on copies; measured on this
        CPU and applied to it only: Cluster.workspace() is empty for a GPU preset).

        ZeRO-1/2 publish every parameter with all-gathers issued at once; ZeRO-2
        reduce-scatters a bucket at a time, ZeRO-3 gathers a block at a time;
        plain DP all-reduces a bucket at a time. param_bytes: this device's
        fp32 parameters before sharding (one bucket at most holds them all).
        """
        w = self.cluster.workspace()
        if not w or lay.token_shards == 1:
            return 0.0
        bucket = min(self.bucket_bytes, param_bytes)
        if lay.zero_stage in (1, 2):
            per_bucket = w.get("reduce_scatter" if lay.zero_stage == 2 else "all_reduce", 0.0)
            return w.get("all_gather", 0.0) * param_bytes + per_bucket * bucket
        if lay.zero_stage >= 3:
            block = self._largest_block_bytes(grid_cost.weight_shards(lay))
            return w.get("all_gather", 0.0) * min(block, param_bytes) + w.get("reduce_scatter", 0.0) * block
        return w.get("all_reduce", 0.0) * bucket

    # -- the whole step ----------------------------------------------------------------
    def stage_memory(self, lay: Layout, stage: int) -> dict[str, float]:
        """Bytes on pipeline rank `stage` (estimate() keeps the first and last stage's, or all when v > 1)."""
        all_chunks = chunk_layers(self.spec.cfg.n_layer, lay.pp, lay.virtual_stages)
        return self._memory(stage, device_chunks(lay.schedule, lay.pp, lay.virtual_stages, stage), lay, all_chunks,
                            local_tokens(lay.micro_batch * self.spec.seq_len, lay.cp))

    def estimate(self, lay: Layout) -> Estimate:
        spec, c = self.spec, self.spec.cfg
        tokens = local_tokens(lay.micro_batch * spec.seq_len, lay.cp)  # one rank's share of a micro-batch
        geo = self.groups(lay)
        all_chunks = chunk_layers(c.n_layer, lay.pp, lay.virtual_stages)
        last_chunk = len(all_chunks) - 1
        p2p_bytes = self._p2p_bytes(lay)
        p2p = self.cost("p2p", p2p_bytes, geo["pp"]) if lay.pp > 1 else NONE
        chunk_times, stage_busy, mems = [], [], {}
        comm_sent = {"tp": 0.0, "ep": 0.0, "cp": 0.0}
        t_tp_ep = t_rc = t_cp = 0.0
        busy = NONE  # the links one device's collectives hold over the step (the busiest stage's)
        for s in range(lay.pp):
            chunks = device_chunks(lay.schedule, lay.pp, lay.virtual_stages, s)
            row, held = [], NONE
            for k in chunks:
                f, b, rc = self._chunk_compute(all_chunks[k], k == last_chunk, lay, tokens, first=k == 0)
                cf, cb, sent, links = self._chunk_comm_links(all_chunks[k], lay, tokens, k == 0, k == last_chunk)
                pf = pb = 0.0
                if lay.cp > 1:  # the ring's hops (or Ulysses' all-to-alls) of each block
                    pf, pb, cp_sent, cp_links = self._chunk_cp(all_chunks[k], lay, tokens, geo["cp"])
                    links, sent = links + cp_links, {**sent, "cp": cp_sent}
                cf, cb = cf + pf, cb + pb
                row.append((f + cf, b + rc + cb))
                held = held + links.times(lay.chunks)
                if s == 0:
                    t_tp_ep += (cf + cb - pf - pb) * lay.chunks
                    t_cp += (pf + pb) * lay.chunks
                    t_rc += rc * lay.chunks
                    for key in comm_sent:
                        comm_sent[key] += sent.get(key, 0.0) * lay.chunks
            if lay.pp > 1:
                held = held + p2p.times(sum(c.count for c in pp_calls(p2p_bytes, chunks, len(all_chunks),
                                                                        lay.chunks)))
            busy = max(busy, held, key=lambda x: max(x.nvlink_s, x.nic_s))
            chunk_times.append(row)
            stage_busy.append(sum(f + b for f, b in row))
            if s in (0, lay.pp - 1) or lay.virtual_stages > 1:
                mems[s] = self._memory(s, chunks, lay, all_chunks, tokens)
        memory = max(mems.values(), key=lambda mm: mm["total"])
        t_pipe = pipeline_time(stage_busy, lay.micro_batches, lay.virtual_stages, p2p.seconds)
        if lay.schedule in NEW_SCHEDULES:
            t_pipe = flush_time(lay.schedule, stage_busy, [sum(f for f, _ in row) for row in chunk_times],
                                lay.micro_batches, lay.virtual_stages, p2p.seconds)
        compute_busy = max(stage_busy) * lay.micro_batches
        bubble = 1 - compute_busy / t_pipe if t_pipe > 0 else 0.0
        dp_exposed, dp_total, dp_bytes, dp_links, dp_split = self._dp_time(lay, geo, chunk_times, memory)
        opt = self._optimizer_time(memory, lay)
        book, book_links = self._bookkeeping_time(lay, geo)
        busy = busy + dp_links + book_links
        fixed = opt + self.cal.step_overhead_s  # no communication overlaps these
        path = lay.grad_accum * t_pipe + dp_exposed + fixed + book
        # links are shared: everything a device sends or receives queues on its NVLink and its NIC
        link_bound = max(busy.nvlink_s, busy.nic_s) + fixed
        t_step = max(path, link_bound)
        busy_compute = max(stage_busy) * lay.micro_batches * lay.grad_accum
        global_tokens = lay.global_batch * spec.seq_len
        model_flops = self.model_flops_tok * global_tokens / t_step / lay.world
        hw_flops = (self.model_flops_tok + self._recompute_flops_per_token(lay)) * global_tokens / t_step / lay.world
        peak = self.cluster.peak_flops["bf16" if self.precision == "bf16" else "fp32"]
        pp_comm = 2 * (lay.pp * lay.virtual_stages - 1) * p2p.seconds * lay.grad_accum if lay.pp > 1 else 0.0
        time = {"compute": busy_compute - t_tp_ep - t_rc - t_cp,
                "recompute": t_rc, "tp+ep comm": t_tp_ep, "cp comm": t_cp,
                "pp comm": pp_comm,
                "bubble": lay.grad_accum * (t_pipe - compute_busy) - pp_comm,
                "dp comm (exposed)": dp_exposed, "optimizer": opt,
                "overhead": self.cal.step_overhead_s + book, "link-bound wait": t_step - path}
        comm_sent["pp"] = 2 * p2p_bytes * lay.chunks * lay.virtual_stages if lay.pp > 1 else 0.0
        comm_sent["dp"] = dp_bytes
        fits = memory["total"] <= self.cluster.memory * self.cluster.usable_memory
        return Estimate(lay, t_step, global_tokens / t_step, model_flops, model_flops / peak, memory, time,
                        comm_sent, bubble, fits, chunk_times, p2p.seconds, dp_total, mems,
                        {a: ("intra" if geo[a].nodes == 1 else "inter") for a in ("tp", "pp", "dp", "ep", "cp")
                         if getattr(lay, a) > 1}, hw_flops, {"nvlink": busy.nvlink_s, "nic": busy.nic_s}, path,
                        t_pipe, link_bound, "formula", *dp_split)

    def _recompute_flops_per_token(self, lay: Layout) -> float:
        """FLOPs per token the recomputed forwards add: every block's forward (full), or every attention
        core's (selective). Counted by hardware FLOP/s, not by MFU."""
        if lay.recompute == "full":
            return sum(self.layer_flops)
        if lay.recompute == "selective":
            return self.spec.cfg.n_layer * self.attention_core_flops(1)
        return 0.0

    def _dp_time(self, lay: Layout, geo, chunk_times, memory) -> tuple[float, float, float, Cost, tuple]:
        """(exposed seconds, total seconds, bytes sent, links held, (reduce-scatter seconds per micro-batch,
        seconds per step, gather seconds per micro-batch)) of
        gradient/parameter traffic over dp (x ep).

        The calls are tessel.planner.traffic.dp_step_calls. Bucketed
        gradient reductions overlap the backward that fills the buckets (Li et
        al. 2020) as far as the cluster's measured overlap allows, all but the
        last bucket; ZeRO-3's weight gathers are prefetched under the micro-
        batch's compute (Rajbhandari et al. 2020); the all-gather of the
        updated shards after the optimizer step (stages 1, 2) is exposed.
        What hides behind compute still holds the links: the step's link bound
        (estimate) sees all of it.
        """
        n = lay.token_shards
        if n == 1:
            return 0.0, 0.0, 0.0, NONE, (0.0, 0.0, 0.0)
        g = geo["dp"]
        sharded = lay.zero_stage >= 2 and lay.pp == 1  # under a pipeline the step's gradients stay whole
        # unsharded fp32-equivalent gradient bytes (the call lists count fp32 buffers)
        grads_full = 4 * (memory["grads"] / self._reduce_bytes(lay)) * (n if sharded else 1)
        ov = self.cluster.overlap
        per_mb, per_step = self._dp_calls(lay, grads_full, [0], chunk_layers(self.spec.cfg.n_layer, lay.pp, 1))
        nb = max(1, sum(c.count for c in (per_mb or per_step) if c.op in ("all_reduce", "reduce_scatter")))
        bwd_stage = max(sum(b for _, b in row) for row in chunk_times)
        reduce_step = self.price_group([c for c in per_step if c.op in ("all_reduce", "reduce_scatter")], g)
        gather_step = self.price_group([c for c in per_step if c.op == "all_gather"], g)
        rs = self.price_group([c for c in per_mb if c.op == "reduce_scatter"], g)
        ag = self.price_group([c for c in per_mb if c.op == "all_gather"], g)
        # one bucket's reduction at a time hides behind the rest of backward
        exposed_step = reduce_step.seconds - ov * min(reduce_step.seconds * (1 - 1 / nb), bwd_stage)
        exposed_step += gather_step.seconds
        exposed_mb = rs.seconds - ov * min(rs.seconds * (1 - 1 / nb), bwd_stage)
        if ag.seconds:
            compute = min(sum(f + b for f, b in row) for row in chunk_times)  # one micro-batch on one stage
            exposed_mb += max(ag.seconds * (1 - ov), ag.seconds - ov * compute)
        total = (rs.seconds + ag.seconds) * lay.chunks + reduce_step.seconds + gather_step.seconds
        sent = sent_bytes(per_mb, n) * lay.chunks + sent_bytes(per_step, n)
        links = (rs + ag).times(lay.chunks) + reduce_step + gather_step
        split = (rs.seconds, reduce_step.seconds + gather_step.seconds, ag.seconds)
        return exposed_mb * lay.chunks + exposed_step, total, sent, links, split

    def _bookkeeping(self, lay: Layout, stage: int = 0) -> dict[str, list[Call]]:
        c = self.spec.cfg
        tied = 4 * c.vocab_size * c.d_model / lay.tp if c.tie_embeddings and lay.pp > 1 else 0.0
        return bookkeeping_calls(lay.tp, lay.pp, lay.token_shards, lay.zero_stage, stage, tied)

    def _bookkeeping_time(self, lay: Layout, geo) -> tuple[float, Cost]:
        """Per-step collectives of the trainer beyond the calibration's overhead (which holds the
        world-wide ones, tessel.planner.traffic.trainer_calls): the gradient norm's partial sums,
        the pipeline's loss message, its two metric all-reduces and its tied-embedding gradient."""
        groups = {"tp": geo["tp"], "pp": geo["pp"], "dp": geo["dp"], "tied": replace(geo["pp"], n=2)}
        total = NONE
        for group, calls in self._bookkeeping(lay).items():
            total = total + self.price_group(calls, groups[group])
        return total.seconds, total

    def step_calls(self, lay: Layout, stage: int = 0) -> dict[str, list[Call]]:
        """Every collective and message one rank of pipeline stage `stage` issues in one optimizer
        step, by the group it runs on ("tp", "ep", "pp", "dp": dp x ep, "tied", "world"): the
        lists the estimate prices, whole (tests/planner/test_traffic_matches_runtime.py compares
        them with a real step's)."""
        c = self.spec.cfg
        tokens = local_tokens(lay.micro_batch * self.spec.seq_len, lay.cp)
        all_chunks = chunk_layers(c.n_layer, lay.pp, lay.virtual_stages)
        mine = [stage + j * lay.pp for j in range(lay.virtual_stages)]
        out: dict[str, list[Call]] = collections.defaultdict(list)
        full = lay.recompute == "full"
        for k in mine:
            layers = all_chunks[k]
            n_moe = sum(self.moe_flags[i] for i in layers)
            grid = grid_cost.layout_grid(lay)
            if grid is not None:  # on the grid's groups: "tp.0", "tp.1", ... (grid dims, outermost first)
                f, b = self._grid_calls(grid, len(layers), k == 0, k == len(all_chunks) - 1, lay, tokens)
                for dim, c in f + b:
                    out[f"tp.{dim}"] += times([c], lay.chunks)
            elif lay.tp > 1:
                f, b = self._tp_calls(len(layers) - n_moe, n_moe, tokens, lay.sequence_parallel, full, k == 0,
                                      k == len(all_chunks) - 1)
                out["tp"] += times(f + b, lay.chunks)
            if n_moe and lay.ep > 1:
                f, b = self._ep_calls(n_moe, tokens, full)
                out["ep"] += times(f + b, lay.chunks)
            if lay.cp > 1:
                f, b = self._cp_calls(lay, tokens)
                out["cp"] += times(f + b, lay.chunks * len(layers))
        if lay.pp > 1:
            out["pp"] += pp_calls(self._p2p_bytes(lay), mine, len(all_chunks), lay.chunks)
        if lay.token_shards > 1:
            dense, expert = self._stage_params(mine, lay, all_chunks)
            per_mb, per_step = self._dp_calls(lay, 4 * (dense + expert), mine, all_chunks)
            out["dp"] += times(per_mb, lay.chunks) + per_step
        for calls in (self._bookkeeping(lay, stage), trainer_calls(lay.world, lay.token_shards)):
            for group, more in calls.items():
                out[group] += more
        return {group: merged(calls) for group, calls in out.items() if calls}

    def _dp_calls(self, lay: Layout, grad_bytes: float, chunks: list[int],
                  all_chunks: list[list[int]]) -> tuple[list[Call], list[Call]]:
        """(per micro-batch, per step) dp x ep calls of a rank holding `chunks`, `grad_bytes` of whole
        fp32 gradients: ZeRO-3's units are the blocks of its first chunk, the root the rest. Under
        bf16 storage the gathers move bf16 parameters and the reductions the reduce dtype's gradients."""
        units = [4 * sum(self.layer_params[i]) / grid_cost.weight_shards(lay) for i in all_chunks[chunks[0]]]
        root = max(0.0, grad_bytes - sum(units))  # embedding, head, final norm on this stage
        per_mb, per_step = dp_step_calls(grad_bytes, lay.zero_stage, self.bucket_bytes, units, root,
                                         whole_step=lay.pp > 1)
        pb, rb = self._param_bytes(lay), self._reduce_bytes(lay)
        if pb == 4 and rb == 4:
            return per_mb, per_step
        scale = {"all_gather": pb / 4, "all_reduce": rb / 4, "reduce_scatter": rb / 4}
        return ([Call(x.op, x.nbytes * scale[x.op], x.count) for x in per_mb],
                [Call(x.op, x.nbytes * scale[x.op], x.count) for x in per_step])

    def _optimizer_time(self, memory, lay: Layout) -> float:
        n_params = memory["optimizer"] / (8 if self._param_bytes(lay) == 4 else 12)  # the shard this device updates
        if self.cal.opt_s_per_param is not None:
            return n_params * self.cal.opt_s_per_param
        per_param = ADAM_BYTES_TOUCHED
        if self.roofline:  # the clip reads and scales the gradient shard; bf16 storage publishes the masters
            per_param += CLIP_BYTES + (PUBLISH_BYTES if self._param_bytes(lay) == 2 else 0)
            return n_params * per_param / (self.cluster.mem_bandwidth * self.cluster.hbm_efficiency)
        return n_params * per_param / self.cluster.mem_bandwidth


# dp: the gradients' group, every axis that sees different tokens (tessel.axes.TOKEN_AXES)
GROUP_AXES = {"tp": ("tp",), "pp": ("pp",), "ep": ("ep",), "dp": ("dp", "ep", "cp"), "dp_expert": ("dp", "cp"),
              "cp": ("cp",)}
