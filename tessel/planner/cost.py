"""The cost model: FLOPs, memory and communication of one training step under a layout.

Everything is per device and per optimizer step, for tessel's reference GPT.
Sources of each formula are cited where they are used; the hand-checkable
pieces (collective times, activation bytes, in-flight micro-batches, ZeRO
shards) are small functions with unit tests in tests/planner/test_cost.py.

Communication is priced call by call: tessel.planner.traffic lists the
collectives tessel's layers, data-parallel wrappers and pipeline issue, and
each call costs the probe's measured fit for its op and group size on "this"
machine, or the ring alpha-beta formula below on a preset cluster.

Placement: ranks are ordered pp > dp > ep > tp (tp innermost), as tessel.mesh
lays them out; a group is priced on the intra-node link when it fits in a node
and on the inter-node link otherwise (tessel.planner.cluster.link_for).
"""

from __future__ import annotations

import bisect
import collections
import math
from dataclasses import dataclass, field

from tessel.axes import AXES
from tessel.planner.cluster import Cluster, Link, link_for
from tessel.planner.layout import Layout
from tessel.planner.memory import head_activation_bytes, layer_activation_bytes, recompute_layer_bytes, zero_shards
from tessel.planner.model_spec import ModelSpec
from tessel.planner.traffic import (Call, bookkeeping_calls, dp_step_calls, ep_chunk_calls, merged, pp_calls,
                                    times, tp_chunk_calls, trainer_calls)

ORDER = AXES  # tessel.mesh lays ranks out in this order by default
ADAM_BYTES_TOUCHED = 28  # per parameter: read+write fp32 weight, m, v (24) + read the gradient (4)


# ---- alpha-beta collectives (Thakur et al. 2005; NCCL's bus-bandwidth factors) ----

def all_reduce_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-reduce: 2(n-1) steps of nbytes/n each."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.latency


def all_gather_time(nbytes: float, n: int, link: Link) -> float:
    """Ring all-gather (or reduce-scatter) of an nbytes result: n-1 steps of nbytes/n."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


reduce_scatter_time = all_gather_time


def all_to_all_time(nbytes: float, n: int, link: Link) -> float:
    """Each rank keeps 1/n of its nbytes and sends the rest, one message per peer."""
    if n <= 1:
        return 0.0
    return (n - 1) / n * nbytes / link.bandwidth + (n - 1) * link.latency


def p2p_time(nbytes: float, link: Link) -> float:
    return link.latency + nbytes / link.bandwidth


FORMULAS = {"all_reduce": all_reduce_time, "all_gather": all_gather_time, "reduce_scatter": reduce_scatter_time,
            "all_to_all": all_to_all_time, "p2p": lambda nbytes, n, link: p2p_time(nbytes, link)}


def sent_bytes(calls: list[Call], n: int) -> float:
    """Bytes one rank sends for `calls` in a group of n (ring algorithms; all-reduce sends twice)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}
    return sum(c.count * c.nbytes * factor.get(c.op, (n - 1) / n) for c in calls)


# ---- measured compute speed --------------------------------------------------

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
    if schedule == "gpipe":
        return m * v
    if schedule == "interleaved":
        return min(2 * (pp - stage - 1) + (v - 1) * pp + 1, m * v)
    return min(pp - stage, m)


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

    @property
    def memory_total(self) -> float:
        return self.memory["total"]

    def to_json(self) -> dict:
        mib = {k: v / 2**20 for k, v in self.memory.items()}
        return {"layout": self.layout.to_dict(), "describe": self.layout.describe(),
                "step_s": self.step_s, "tokens_per_s": self.tokens_per_s,
                "model_flops_per_device": self.model_flops_per_device, "mfu": self.mfu,
                "memory_mib": mib, "time_s": self.time, "comm_bytes": self.comm_bytes,
                "bubble": self.bubble, "fits": self.fits, "placement": self.placement}


class CostModel:
    """Prices layouts of one model on one cluster at one global batch."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, precision: str = "bf16",
                 calibration: Calibration | None = None, bucket_mb: float = 25.0):
        self.spec, self.cluster, self.precision = spec, cluster, precision
        self.cal = calibration or Calibration()
        self.bucket_bytes = bucket_mb * 2**20
        L = spec.cfg.n_layer
        # tessel's experts compute only the rows they keep (tessel.models.moe.Experts), not a
        # buffer padded to the capacity; the profile converts its times with the same count
        self.layer_flops = [spec.layer_fwd_flops_per_token(i) for i in range(L)]
        self.layer_params = [spec.layer_params(i) for i in range(L)]
        self.act_bytes = 2 if precision == "bf16" else 4
        self.moe_flags = [spec.is_moe(i) for i in range(L)]
        self.model_flops_tok = spec.model_flops_per_token()
        self._comm_memo: dict = {}

    # -- compute ---------------------------------------------------------------
    def flops_per_s(self, tokens: int, tp: int = 1) -> float:
        """Whole-model FLOP/s one rank achieves on micro-batches of `tokens` under `tp`."""
        return self.cal.achieved(tokens, self.cluster.flops(self.precision) * tp, tp)

    def _chunk_compute(self, layers: list[int], last: bool, lay: Layout, tokens: int) -> tuple[float, float, float]:
        """(forward, backward, recompute) seconds of one chunk for one micro-batch on one tp rank."""
        fwd_flops = sum(self.layer_flops[i] for i in layers) * tokens
        head = self.spec.head_fwd_flops_per_token * tokens if last else 0.0
        # measured on the tp-sharded shapes where profiled (small matrices run less efficiently)
        speed = self.flops_per_s(tokens, lay.tp)
        f, h = fwd_flops / speed, head / speed
        return f + h, 2 * (f + h), f if lay.recompute else 0.0

    # -- communication -----------------------------------------------------------
    def links(self, lay: Layout) -> dict[str, Link]:
        sizes = {"pp": lay.pp, "dp": lay.dp, "ep": lay.ep, "tp": lay.tp}
        return {name: link_for(self.cluster, sizes, ORDER, axes)
                for name, axes in (("tp", ("tp",)), ("pp", ("pp",)), ("ep", ("ep",)), ("dp", ("dp", "ep")),
                                   ("dp_expert", ("dp",)))}

    def coll(self, op: str, nbytes: float, n: int, link: Link) -> float:
        """Seconds of one collective: the probe's fit for (op, n) on this machine's one node,
        the alpha-beta formula of the link otherwise."""
        if n <= 1:
            return 0.0
        fit = self.cluster.collectives.get(f"{op}/{2 if op == 'p2p' else n}")
        if fit and link is self.cluster.intra:
            return fit[0] + fit[1] * nbytes
        return FORMULAS[op](nbytes, n, link)

    def price(self, calls: list[Call], n: int, link: Link) -> float:
        return sum(c.count * self.coll(c.op, c.nbytes, n, link) for c in calls)

    def _chunk_comm(self, layers: list[int], lay: Layout, tokens: int, links, first: bool,
                    last: bool) -> tuple[float, float, dict]:
        """(forward, backward) seconds of tp and ep collectives of one chunk for one micro-batch.

        The calls are those tessel's layers issue (tessel.planner.traffic);
        recomputation repeats each block's forward collectives in backward.
        """
        n_moe = sum(self.moe_flags[i] for i in layers)
        key = (len(layers) - n_moe, n_moe, first, last, lay.tp, lay.ep, lay.sp, lay.recompute, tokens,
               links["tp"], links["ep"])
        if key not in self._comm_memo:  # thousands of layouts share a few chunk shapes
            self._comm_memo[key] = self._chunk_comm_priced(*key[:9], links)
        return self._comm_memo[key]

    def _chunk_comm_priced(self, n_dense: int, n_moe: int, first: bool, last: bool, tp: int, ep: int, sp: bool,
                           recompute: bool, tokens: int, links) -> tuple[float, float, dict]:
        lay = Layout(tp=tp, ep=ep, sp=sp, recompute=recompute)
        tp_f, tp_b, ep_f, ep_b = [], [], [], []
        if lay.tp > 1:
            tp_f, tp_b = self._tp_calls(n_dense, n_moe, tokens, lay.sp, lay.recompute, first, last)
        if n_moe and lay.ep > 1:
            ep_f, ep_b = self._ep_calls(n_moe, tokens, lay.recompute)
        k = self._tp_in_step_factor(lay.tp, tokens, links["tp"])
        fwd = k * self.price(tp_f, lay.tp, links["tp"]) + self.price(ep_f, lay.ep, links["ep"])
        bwd = k * self.price(tp_b, lay.tp, links["tp"]) + self.price(ep_b, lay.ep, links["ep"])
        sent = {"tp": sent_bytes(tp_f + tp_b, lay.tp), "ep": sent_bytes(ep_f + ep_b, lay.ep)}
        return fwd, bwd, sent

    def _tp_in_step_factor(self, tp: int, tokens: int, link: Link) -> float:
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
        priced = self.price(f + b, tp, link)
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
        return ep_chunk_calls(c.d_model, tokens, self.act_bytes, c.moe_top_k, c.capacity_factor, c.n_experts,
                              n_moe, recompute)

    def _p2p_bytes(self, lay: Layout) -> float:
        """One pipeline message: a micro-batch's activation (sequence-sharded under SP)."""
        return lay.mb * self.spec.seq_len * self.spec.cfg.d_model * self.act_bytes / (lay.tp if lay.sp else 1)

    # -- memory ----------------------------------------------------------------------
    def _stage_params(self, chunks: list[int], lay: Layout, all_chunks: list[list[int]]) -> tuple[float, float]:
        """(dense, expert) parameters held by one device before ZeRO."""
        dense = expert = 0.0
        for k in chunks:
            for i in all_chunks[k]:
                d, e = self.layer_params[i]
                dense += d
                expert += e
        if 0 in chunks:
            dense += self.spec.embedding_params
        if len(all_chunks) - 1 in chunks:
            dense += self.spec.head_params
        return dense / lay.tp, expert / (lay.tp * lay.ep)

    def _memory(self, stage: int, chunks: list[int], lay: Layout, all_chunks, tokens: int) -> dict[str, float]:
        dense, expert = self._stage_params(chunks, lay, all_chunks)
        zp, zg, zo = zero_shards(lay.zero, lay.dp * lay.ep)
        ep_, eg, eo = zero_shards(lay.zero, lay.dp)
        if lay.pp > 1:  # gradients accumulate whole over the micro-batches, reduce-scattered after the flush
            zg = eg = 1
        mem = {"params": 4 * (dense / zp + expert / ep_),
               "grads": 4 * (dense / zg + expert / eg),
               "optimizer": 8 * (dense / zo + expert / eo)}
        per_layer = [layer_activation_bytes(self.spec, tokens, lay.tp, lay.sp, self.precision, self.moe_flags[i])
                     for k in chunks for i in all_chunks[k]] or [0.0]
        one_layer, biggest = sum(per_layer) / len(per_layer), max(per_layer)  # mean over this device's blocks
        in_flight = peak_chunks_in_flight(lay.schedule, lay.pp, lay.m, stage, lay.v)
        layers_per_chunk = sum(len(all_chunks[k]) for k in chunks) / len(chunks)
        if lay.recompute:
            kept = in_flight * layers_per_chunk * recompute_layer_bytes(self.spec, tokens, lay.tp, lay.sp)
            kept += biggest  # one block rebuilt at a time
        else:
            kept = in_flight * layers_per_chunk * one_layer
        # backward of a block materialises gradients about as large as what it saved
        workspace = biggest
        if len(all_chunks) - 1 in chunks:
            workspace += head_activation_bytes(self.spec, tokens, lay.tp, self.precision)
        mem["activations"] = kept + workspace
        transient = 0.0
        if lay.zero >= 3 and lay.pp > 1:  # under a pipeline the whole stage is gathered for the step
            transient = 4 * (dense + expert)
        elif lay.zero >= 3:  # the gathered weights of the block being computed and the prefetched next
            transient = 2 * self._largest_block_bytes(lay.tp)
        elif lay.zero == 2:
            transient = self.bucket_bytes
        mem["buffers"] = transient + self._collective_workspace(lay, 4 * (dense + expert))
        mem["baseline"] = self.cluster.baseline_memory
        mem["total"] = sum(mem.values())
        return mem

    def _largest_block_bytes(self, tp: int) -> float:
        """fp32 bytes of the biggest block's parameters on one tp rank: what ZeRO-3 gathers at once."""
        return 4 * max(sum(p) for p in self.layer_params) / tp

    def _collective_workspace(self, lay: Layout, param_bytes: float) -> float:
        """Host memory the backend's data-parallel collectives add (gloo works on copies; 0 on presets).

        ZeRO-1/2 publish every parameter with all-gathers issued at once; ZeRO-2
        reduce-scatters a bucket at a time, ZeRO-3 gathers a block at a time;
        plain DP all-reduces a bucket at a time. param_bytes: this device's
        fp32 parameters before sharding (one bucket at most holds them all).
        """
        w = self.cluster.collective_workspace
        if not w or lay.dp * lay.ep == 1:
            return 0.0
        bucket = min(self.bucket_bytes, param_bytes)
        if lay.zero in (1, 2):
            per_bucket = w.get("reduce_scatter" if lay.zero == 2 else "all_reduce", 0.0)
            return w.get("all_gather", 0.0) * param_bytes + per_bucket * bucket
        if lay.zero >= 3:
            block = self._largest_block_bytes(lay.tp)
            return w.get("all_gather", 0.0) * min(block, param_bytes) + w.get("reduce_scatter", 0.0) * block
        return w.get("all_reduce", 0.0) * bucket

    # -- the whole step ----------------------------------------------------------------
    def estimate(self, lay: Layout) -> Estimate:
        spec, c = self.spec, self.spec.cfg
        tokens = lay.mb * spec.seq_len
        links = self.links(lay)
        all_chunks = chunk_layers(c.n_layer, lay.pp, lay.v)
        last_chunk = len(all_chunks) - 1
        p2p_bytes = self._p2p_bytes(lay)
        p2p = self.coll("p2p", p2p_bytes, 2, links["pp"]) if lay.pp > 1 else 0.0
        chunk_times, stage_busy, mems = [], [], {}
        comm_sent = {"tp": 0.0, "ep": 0.0}
        t_tp_ep = t_rc = 0.0
        for s in range(lay.pp):
            chunks = [s + j * lay.pp for j in range(lay.v)]
            row = []
            for k in chunks:
                f, b, rc = self._chunk_compute(all_chunks[k], k == last_chunk, lay, tokens)
                cf, cb, sent = self._chunk_comm(all_chunks[k], lay, tokens, links, k == 0, k == last_chunk)
                row.append((f + cf, b + rc + cb))
                if s == 0:
                    t_tp_ep += (cf + cb) * lay.chunks
                    t_rc += rc * lay.chunks
                    for key in comm_sent:
                        comm_sent[key] += sent[key] * lay.chunks
            chunk_times.append(row)
            stage_busy.append(sum(f + b for f, b in row))
            if s in (0, lay.pp - 1) or lay.v > 1:
                mems[s] = self._memory(s, chunks, lay, all_chunks, tokens)
        memory = max(mems.values(), key=lambda mm: mm["total"])
        # pipeline: the first micro-batch crosses every chunk, the slowest chunk paces the rest
        chunk_max = max(f + b + 2 * p2p for row in chunk_times for f, b in row)
        chunk_sum = sum(f + b + 2 * p2p for row in chunk_times for f, b in row) / lay.v
        t_pipe = (lay.m * lay.v - 1) * chunk_max + chunk_sum if lay.pp > 1 else lay.m * chunk_max
        busy = max(stage_busy) * lay.m
        bubble = 1 - busy / t_pipe if t_pipe > 0 else 0.0
        dp_exposed, dp_total, dp_bytes = self._dp_time(lay, links, chunk_times, memory)
        opt = self._optimizer_time(memory)
        book = self._bookkeeping_time(lay, links)
        t_step = lay.ga * t_pipe + dp_exposed + opt + self.cal.step_overhead_s + book
        busy_compute = max(stage_busy) * lay.m * lay.ga
        global_tokens = lay.global_batch * spec.seq_len
        model_flops = self.model_flops_tok * global_tokens / t_step / lay.world
        peak = self.cluster.peak_flops["bf16" if self.precision == "bf16" else "fp32"]
        time = {"compute": busy_compute - t_tp_ep - t_rc,
                "recompute": t_rc, "tp+ep comm": t_tp_ep,
                "pp comm": 2 * p2p * lay.chunks * lay.v if lay.pp > 1 else 0.0,
                "bubble": lay.ga * (t_pipe - busy), "dp comm (exposed)": dp_exposed, "optimizer": opt,
                "overhead": self.cal.step_overhead_s + book}
        comm_sent["pp"] = 2 * p2p_bytes * lay.chunks * lay.v if lay.pp > 1 else 0.0
        comm_sent["dp"] = dp_bytes
        fits = memory["total"] <= self.cluster.memory * self.cluster.usable_memory
        return Estimate(lay, t_step, global_tokens / t_step, model_flops, model_flops / peak, memory, time,
                        comm_sent, bubble, fits, chunk_times, p2p, dp_total, mems,
                        {a: ("intra" if links[a] is self.cluster.intra else "inter") for a in ("tp", "pp", "dp", "ep")
                         if getattr(lay, a) > 1})

    def _dp_time(self, lay: Layout, links, chunk_times, memory) -> tuple[float, float, float]:
        """(exposed seconds, total seconds, bytes sent) of gradient/parameter traffic over dp (x ep).

        The calls are tessel.planner.traffic.dp_step_calls. Bucketed
        gradient reductions overlap the backward that fills the buckets (Li et
        al. 2020) as far as the cluster's measured overlap allows, all but the
        last bucket; ZeRO-3's weight gathers are prefetched under the micro-
        batch's compute (Rajbhandari et al. 2020); the all-gather of the
        updated shards after the optimizer step (stages 1, 2) is exposed.
        """
        n = lay.dp * lay.ep
        if n == 1:
            return 0.0, 0.0, 0.0
        sharded = lay.zero >= 2 and lay.pp == 1  # under a pipeline the step's gradients stay whole
        grads_full = memory["grads"] * (n if sharded else 1)  # unsharded fp32 gradient bytes
        link, ov = links["dp"], self.cluster.overlap
        per_mb, per_step = self._dp_calls(lay, grads_full, [0], chunk_layers(self.spec.cfg.n_layer, lay.pp, 1))
        nb = max(1, sum(c.count for c in (per_mb or per_step) if c.op in ("all_reduce", "reduce_scatter")))
        bwd_stage = max(sum(b for _, b in row) for row in chunk_times)
        reduce_step = self.price([c for c in per_step if c.op in ("all_reduce", "reduce_scatter")], n, link)
        gather_step = self.price([c for c in per_step if c.op == "all_gather"], n, link)
        rs = self.price([c for c in per_mb if c.op == "reduce_scatter"], n, link)
        ag = self.price([c for c in per_mb if c.op == "all_gather"], n, link)
        # one bucket's reduction at a time hides behind the rest of backward
        exposed_step = reduce_step - ov * min(reduce_step * (1 - 1 / nb), bwd_stage) + gather_step
        exposed_mb = rs - ov * min(rs * (1 - 1 / nb), bwd_stage)
        if ag:
            compute = min(sum(f + b for f, b in row) for row in chunk_times)  # one micro-batch on one stage
            exposed_mb += max(ag * (1 - ov), ag - ov * compute)
        total = (rs + ag) * lay.chunks + reduce_step + gather_step
        sent = sent_bytes(per_mb, n) * lay.chunks + sent_bytes(per_step, n)
        return exposed_mb * lay.chunks + exposed_step, total, sent

    def _bookkeeping(self, lay: Layout, stage: int = 0) -> dict[str, list[Call]]:
        c = self.spec.cfg
        tied = 4 * c.vocab_size * c.d_model / lay.tp if c.tie_embeddings and lay.pp > 1 else 0.0
        return bookkeeping_calls(lay.tp, lay.pp, lay.dp * lay.ep, lay.zero, stage, tied)

    def _bookkeeping_time(self, lay: Layout, links) -> float:
        """Per-step collectives of the trainer beyond the calibration's overhead (which holds the
        world-wide ones, tessel.planner.traffic.trainer_calls): the gradient norm's partial sums,
        the pipeline's loss message, its two metric all-reduces and its tied-embedding gradient."""
        sizes = {"tp": lay.tp, "pp": lay.pp, "dp": lay.dp * lay.ep, "tied": 2}
        link = {"tp": links["tp"], "pp": links["pp"], "dp": links["dp"], "tied": links["pp"]}
        return sum(self.price(calls, sizes[group], link[group]) for group, calls in self._bookkeeping(lay).items())

    def step_calls(self, lay: Layout, stage: int = 0) -> dict[str, list[Call]]:
        """Every collective and message one rank of pipeline stage `stage` issues in one optimizer
        step, by the group it runs on ("tp", "ep", "pp", "dp": dp x ep, "tied", "world"): the
        lists the estimate prices, whole (tests/planner/test_traffic_matches_runtime.py compares
        them with a real step's)."""
        c = self.spec.cfg
        tokens = lay.mb * self.spec.seq_len
        all_chunks = chunk_layers(c.n_layer, lay.pp, lay.v)
        mine = [stage + j * lay.pp for j in range(lay.v)]
        out: dict[str, list[Call]] = collections.defaultdict(list)
        for k in mine:
            layers = all_chunks[k]
            n_moe = sum(self.moe_flags[i] for i in layers)
            if lay.tp > 1:
                f, b = self._tp_calls(len(layers) - n_moe, n_moe, tokens, lay.sp, lay.recompute, k == 0,
                                      k == len(all_chunks) - 1)
                out["tp"] += times(f + b, lay.chunks)
            if n_moe and lay.ep > 1:
                f, b = self._ep_calls(n_moe, tokens, lay.recompute)
                out["ep"] += times(f + b, lay.chunks)
        if lay.pp > 1:
            out["pp"] += pp_calls(self._p2p_bytes(lay), mine, len(all_chunks), lay.chunks)
        if lay.dp * lay.ep > 1:
            dense, expert = self._stage_params(mine, lay, all_chunks)
            per_mb, per_step = self._dp_calls(lay, 4 * (dense + expert), mine, all_chunks)
            out["dp"] += times(per_mb, lay.chunks) + per_step
        for calls in (self._bookkeeping(lay, stage), trainer_calls(lay.world, lay.dp * lay.ep)):
            for group, more in calls.items():
                out[group] += more
        return {group: merged(calls) for group, calls in out.items() if calls}

    def _dp_calls(self, lay: Layout, grad_bytes: float, chunks: list[int],
                  all_chunks: list[list[int]]) -> tuple[list[Call], list[Call]]:
        """(per micro-batch, per step) dp x ep calls of a rank holding `chunks`, `grad_bytes` of whole
        fp32 gradients: ZeRO-3's units are the blocks of its first chunk, the root the rest."""
        units = [4 * sum(self.layer_params[i]) / lay.tp for i in all_chunks[chunks[0]]]
        root = max(0.0, grad_bytes - sum(units))  # embedding, head, final norm on this stage
        return dp_step_calls(grad_bytes, lay.zero, self.bucket_bytes, units, root, whole_step=lay.pp > 1)

    def _optimizer_time(self, memory) -> float:
        n_params = memory["optimizer"] / 8  # the shard this device updates
        if self.cal.opt_s_per_param is not None:
            return n_params * self.cal.opt_s_per_param
        return n_params * ADAM_BYTES_TOUCHED / self.cluster.mem_bandwidth

