"""Discrete-event simulation of one training step of a plan.

Scale by symmetry: every data-parallel replica of a pipeline runs the same
events at the same times, and every tensor-parallel rank of a stage does the
same work, so one representative pipeline (one device per stage) stands for
all pp*dp*ep*tp devices. Its tensor/expert-parallel collectives are folded
into the compute ops' durations (they are blocking and intra-stage); what is
simulated is the schedule's order and dependencies, the pipeline's point-to-point
transfers, and the data-parallel gradient buckets, which share each device's
links. A link has a bandwidth; concurrent transfers on it split it equally
and a transfer moves at the rate of its most loaded link (the sender's
egress and the receiver's ingress), re-evaluated whenever a transfer starts
or ends. The cost of a simulation grows with pp * micro-batches * virtual
stages, not with the number of devices, so thousands of devices are cheap.
"""

from __future__ import annotations

import heapq
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from tessel.parallel.pipeline.schedules import COMPUTE, is_vshape, owner_of, stage_of
from tessel.planner.cluster import Link
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.layout import Layout
from tessel.planner.schedule import carried, pipeline_schedule, splits_backward

INF = float("inf")


@dataclass
class Event:
    device: int
    row: str  # "compute" or "comm"
    name: str
    start: float
    end: float


@dataclass
class _Transfer:
    name: str
    src: int
    dst: int | None
    links: tuple
    remaining: float
    ready_at: float  # after the latency
    on_done: object
    start: float = 0.0
    total: float = 0.0


@dataclass
class SimResult:
    step_s: float
    pipeline_s: float
    bubble: float
    events: list[Event] = field(default_factory=list)

    def chrome_trace(self) -> dict:
        """Chrome trace format (chrome://tracing, Perfetto): one process per stage, compute and comm rows."""
        ev = [{"name": e.name, "cat": e.row, "ph": "X", "ts": e.start * 1e6, "dur": (e.end - e.start) * 1e6,
               "pid": e.device, "tid": 0 if e.row == "compute" else 1} for e in self.events]
        names = {e.device for e in self.events}
        meta = [{"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"stage {d}"}} for d in names]
        meta += [{"name": "thread_name", "ph": "M", "pid": d, "tid": t, "args": {"name": n}}
                 for d in names for t, n in ((0, "compute"), (1, "comm"))]
        return {"traceEvents": meta + ev, "displayTimeUnit": "ms",
                "otherData": {"step_s": self.step_s, "bubble": self.bubble}}


class PipelineSim:
    """One pipeline: p devices, each running the forwards and backwards of the runtime's action lists in order.

    `schedule` is the list the runner executes (planner/schedule.py); its
    compute actions are replayed here, and each finished one sends its output
    (or input gradient) over the pipeline link as a transfer.
    """

    def __init__(self, chunk_times: list[list[tuple[float, float]]], schedule: str, m: int, v: int = 1,
                 p2p_bytes: float = 0.0, pp_link: Link | None = None, pp_class: str = "pp"):
        self.p, self.m, self.v = len(chunk_times), m, v
        self.times = chunk_times
        self.schedule = pipeline_schedule(schedule, self.p, m, v)
        self.vshape = is_vshape(schedule)
        # a split backward: B and W take half of the chunk's backward each (Qi et al. 2023's B = W); the
        # weight gradients (W) are what data parallelism's buckets follow
        self.split = splits_backward(schedule)
        self.grad_kind = "W" if self.split else "B"
        self.ops = [[a for a in actions if a.kind in COMPUTE] for actions in self.schedule]
        self.last_b = [max(i for i, a in enumerate(ops) if a.kind == self.grad_kind) for ops in self.ops]
        self.p2p_bytes = p2p_bytes
        self.pp_link = pp_link or Link(INF, 0.0)
        self.now = 0.0
        self.next_op = [0] * self.p
        self.busy_until = [0.0] * self.p
        self.running = [False] * self.p
        self.arrived: set[tuple] = set()
        self.events: list[Event] = []
        self.compute_heap: list[tuple[float, int, int]] = []  # (end, device, op index)
        self.transfers: list[_Transfer] = []
        self.link_bw: dict[tuple, float] = {}
        self.pp_class = pp_class
        self.b_hook = None  # called as b_hook(stage, start, end, is_last_backward) when a backward starts
        self.f_hook = None  # called as f_hook(stage, start) when a forward starts
        self.compute_end = [0.0] * self.p
        self.on_op = None  # called as on_op(done, total) when a compute op finishes (a progress bar)
        self.ops_done, self.ops_total = 0, sum(len(ops) for ops in self.ops)
        for r, done in enumerate(carried(schedule, self.p, m) or ()):  # an asynchronous step's inheritance
            for kind, mb, chunk in done:
                g = self._global_chunk(r, chunk)
                if kind == "F" and g < self.p * v - 1:
                    self.arrived.add(("F", mb, g + 1))
                elif kind == "B" and g > 0:
                    self.arrived.add(("B", mb, g - 1))

    # ---- dependencies ----------------------------------------------------
    def _global_chunk(self, stage: int, chunk: int) -> int:
        return stage_of(self.p, stage, chunk, self.vshape)

    def _ready(self, s: int) -> bool:
        if self.next_op[s] >= len(self.ops[s]) or self.running[s]:
            return False
        a = self.ops[s][self.next_op[s]]
        g = self._global_chunk(s, a.chunk)
        if a.kind == "W":  # its B ran before it on this device
            return True
        if a.kind == "F":
            return g == 0 or ("F", a.mb, g) in self.arrived
        return g == self.p * self.v - 1 or ("B", a.mb, g) in self.arrived

    def _start_ops(self) -> None:
        for s in range(self.p):
            if self._ready(s):
                a = self.ops[s][self.next_op[s]]
                kind, mb, chunk = a.kind, a.mb, a.chunk
                f, b = self.times[s][chunk]
                dur = f if kind == "F" else b / 2 if self.split else b
                self.running[s] = True
                end = self.now + dur
                heapq.heappush(self.compute_heap, (end, s, self.next_op[s]))
                label = f"{kind}{mb}" + (f".{chunk}" if self.v > 1 else "")
                self.events.append(Event(s, "compute", label, self.now, end))
                if self.b_hook is not None and kind == self.grad_kind:
                    self.b_hook(s, self.now, end, self._is_last_b(s, self.next_op[s]))
                if self.f_hook is not None and kind == "F":
                    self.f_hook(s, self.now)

    def _is_last_b(self, s: int, i: int) -> bool:
        return i == self.last_b[s]

    def _finish_op(self, s: int, i: int) -> None:
        a = self.ops[s][i]
        kind, mb, chunk = a.kind, a.mb, a.chunk
        self.running[s] = False
        self.next_op[s] = i + 1
        self.compute_end[s] = self.now
        self.ops_done += 1
        if self.on_op is not None:
            self.on_op(self.ops_done, self.ops_total)
        g = self._global_chunk(s, chunk)
        last = self.p * self.v - 1
        if kind == "F" and g < last:
            self._send(s, owner_of(self.p, g + 1, self.vshape)[0], ("F", mb, g + 1))
        elif kind == "B" and g > 0:
            self._send(s, owner_of(self.p, g - 1, self.vshape)[0], ("B", mb, g - 1))

    def _send(self, src: int, dst: int, key: tuple) -> None:
        if src == dst or self.p2p_bytes <= 0 or (self.pp_link.bandwidth == INF and self.pp_link.latency == 0):
            self.arrived.add(key)
            return
        links = (("out", src, self.pp_class), ("in", dst, self.pp_class))
        for ln in links:
            self.link_bw[ln] = self.pp_link.bandwidth
        self.add_transfer(_Transfer(f"send {key[0]}{key[1]}", src, dst, links, self.p2p_bytes,
                                    self.now + self.pp_link.latency, lambda: self.arrived.add(key)))

    def add_transfer(self, t: _Transfer) -> None:
        t.start, t.total = self.now, t.remaining
        self.transfers.append(t)

    # ---- fluid link sharing ---------------------------------------------
    def _rates(self) -> dict[int, float]:
        active = [t for t in self.transfers if t.ready_at <= self.now + 1e-15]
        load: dict[tuple, int] = {}
        for t in active:
            for ln in t.links:
                load[ln] = load.get(ln, 0) + 1
        return {id(t): min(self.link_bw[ln] / load[ln] for ln in t.links) for t in active}

    def run(self) -> float:
        """Advance until every op and transfer is done; returns the time of the last event."""
        self._start_ops()
        while self.compute_heap or self.transfers:
            rates = self._rates()
            t_next = self.compute_heap[0][0] if self.compute_heap else INF
            for t in self.transfers:
                if id(t) in rates:
                    t_next = min(t_next, self.now + t.remaining / rates[id(t)])
                else:
                    t_next = min(t_next, t.ready_at)
            dt = t_next - self.now
            for t in self.transfers:
                if id(t) in rates:
                    t.remaining -= rates[id(t)] * dt
            self.now = t_next
            # done when (almost) nothing is left, or when what is left would not move the clock
            done = [t for t in self.transfers if id(t) in rates and (
                t.remaining <= 1e-9 * t.total or self.now + t.remaining / rates[id(t)] <= self.now)]
            for t in done:
                self.transfers.remove(t)
                self.events.append(Event(t.src, "comm", t.name, t.start, self.now))
                t.on_done()
            while self.compute_heap and self.compute_heap[0][0] <= self.now + 1e-15:
                _, s, i = heapq.heappop(self.compute_heap)
                self._finish_op(s, i)
            self._start_ops()
        stuck = [s for s in range(self.p) if self.next_op[s] < len(self.ops[s])]
        if stuck:
            raise RuntimeError(f"schedule deadlocked on stages {stuck}")
        return self.now


def simulate_pipeline(chunk_times, schedule: str, m: int, v: int = 1, p2p_bytes: float = 0.0,
                      pp_link: Link | None = None) -> SimResult:
    """Simulate the pipeline alone (no data parallelism): for checking schedules against formulas."""
    sim = PipelineSim(chunk_times, schedule, m, v, p2p_bytes, pp_link)
    end = sim.run()
    busy = max(sum(f + b for f, b in row) for row in chunk_times) * m
    return SimResult(end, end, 1 - busy / end if end else 0.0, sim.events)


def simulate_plan(cm: CostModel, lay: Layout, est: Estimate | None = None,
                  progress: Callable[[int, int], None] | None = None) -> SimResult:
    """One optimizer step of `lay`: grad_accum pipeline flushes, the gradient traffic, the optimizer;
    progress(done, total) hears of each compute op of the simulated flush."""
    est = est or cm.estimate(lay)
    links = cm.links(lay)
    cls = {k: ("inter" if v == cm.cluster.inter else "intra") for k, v in links.items()}
    split = lay.sequence_parallel or lay.tp_mode != "1d"  # sequence parallelism, or a grid, splits the message over tp
    p2p_bytes = (lay.micro_batch * cm.spec.seq_len * cm.spec.cfg.d_model * cm.act_bytes / (lay.tp if split else 1)
                 / lay.cp)
    schedule = lay.schedule if lay.pp > 1 else "1f1b"
    args = (est.chunk_times, schedule, lay.micro_batches, lay.virtual_stages, p2p_bytes if lay.pp > 1 else 0.0,
            cm.message_link(links["pp"]),
            cls["pp"])
    # earlier accumulation steps are identical flushes without gradient traffic (ZeRO<2):
    # simulate one and shift the last by its length
    offset = (lay.grad_accum - 1) * PipelineSim(*args).run() if lay.grad_accum > 1 and lay.zero_stage < 2 else 0.0
    sim = PipelineSim(*args)
    sim.now = offset
    sim.on_op = progress
    _attach_dp(sim, cm, lay, est, links["dp"], cls["dp"])
    end = sim.run()
    if lay.zero_stage >= 2 and lay.grad_accum > 1:  # every flush carries its own traffic: repeat the whole thing
        end = end * lay.grad_accum
    end += est.time["optimizer"] + est.time["overhead"]
    busy = max(sum(f + b for f, b in row) for row in est.chunk_times) * lay.micro_batches
    pipe = max(sim.compute_end) - offset
    return SimResult(end, pipe * lay.grad_accum, 1 - busy / pipe if pipe else 0.0, sim.events)


class _Stream:
    """One stage's data-parallel communication stream: transfers run one after another, in order."""

    def __init__(self, sim: "PipelineSim", s: int, link: Link, cls: str):
        self.sim, self.s, self.link = sim, s, link
        self.links = (("out", s, cls), ("in", s, cls))
        for ln in self.links:
            sim.link_bw[ln] = link.bandwidth
        self.queue: list[tuple[float, float, float, str]] = []
        self.busy = False

    def submit(self, release: float, nbytes: float, lat: float, name: str) -> None:
        self.queue.append((release, nbytes, lat, name))
        self._pump()

    def _pump(self) -> None:
        if self.busy or not self.queue:
            return
        release, nbytes, lat, name = self.queue.pop(0)
        self.busy = True

        def done() -> None:
            self.busy = False
            self._pump()
        at = max(release, self.sim.now)
        self.sim.add_transfer(_Transfer(name, self.s, None, self.links, max(nbytes, 1e-9), at + lat, done))


def _attach_dp(sim: "PipelineSim", cm: CostModel, lay: Layout, est: Estimate, link: Link, cls: str) -> None:
    """Gradient traffic of each stage, on its own stream sharing the stage's links.

    ZeRO 0/1: buckets released during the stage's last backward (DDP-style
    overlap; at its end when the cluster cannot overlap), all-reduced in order.
    ZeRO 2/3: each backward's reduce-scatter (and ZeRO-3's gathers) after it;
    under a pipeline one reduce-scatter and one all-gather after the stage's
    last backward (gradients accumulate whole over the micro-batches).
    Durations are the cost model's (the network model: hierarchical rails,
    SHARP, NCCL's ring or tree), as bytes at the link's bandwidth, so what
    the simulator adds is the queueing of these transfers on shared links.
    """
    n = lay.token_shards
    if n == 1:
        return
    whole_step = lay.zero_stage >= 2 and lay.pp > 1
    grads = est.memory["grads"] * (n if lay.zero_stage >= 2 and not whole_step else 1)
    overlap = cm.cluster.overlap >= 0.5
    nb, lat = 1, 0.0  # the cost model's seconds include each collective's latency
    if whole_step:
        per_bucket = est.dp_step_s * link.bandwidth
    elif lay.zero_stage <= 1:
        nb = max(1, math.ceil(grads / cm.bucket_bytes))
        per_bucket = est.dp_step_s / nb * link.bandwidth
    else:
        per_bucket = est.dp_mb_s * link.bandwidth
    streams = [_Stream(sim, s, link, cls) for s in range(sim.p)]

    def hook(s: int, start: float, end: float, last: bool) -> None:
        if whole_step:
            if last:
                streams[s].submit(end, per_bucket, lat, "zero rs + ag")
        elif lay.zero_stage >= 2:
            streams[s].submit(end if not overlap else start, per_bucket, lat, "zero rs/ag")
        elif last:
            for k in range(nb):
                release = start + (k + 1) / nb * (end - start) if overlap else end
                streams[s].submit(release, per_bucket, lat, f"dp bucket {k}")
    sim.b_hook = hook
    if est.dp_gather_mb_s > 0 and not whole_step:  # ZeRO-3 gathers each micro-batch's weights, prefetched
        def gather(s: int, start: float) -> None:
            streams[s].submit(start, est.dp_gather_mb_s * link.bandwidth, 0.0, "zero-3 gathers")
        sim.f_hook = gather


def write_trace(result: SimResult, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.chrome_trace()))
    return path


def write_png(result: SimResult, path: str | Path, title: str = "") -> Path:
    """A timeline: one row per stage (compute) and one under it (comm)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    devices = sorted({e.device for e in result.events}) or [0]
    fig, ax = plt.subplots(figsize=(12, 0.5 + 0.6 * len(devices)))
    colors = {"F": "tab:blue", "B": "tab:orange", "s": "tab:gray", "d": "tab:green", "z": "tab:green"}
    bars: dict[tuple, list] = {}  # one broken_barh call per (row, colour): fast for many events
    row_of = {d: i for i, d in enumerate(devices)}
    for e in result.events:
        y = row_of[e.device] * 2 + (0 if e.row == "compute" else 1)
        bars.setdefault((y, colors.get(e.name[0], "tab:purple")), []).append((e.start, e.end - e.start))
    for (y, color), spans in bars.items():
        h = 0.8 if y % 2 == 0 else 0.5
        ax.broken_barh(spans, (y - h / 2, h), facecolors=color, edgecolor="black", linewidth=0.2)
    from matplotlib.patches import Patch
    legend = [("forward", "F"), ("backward", "B"), ("pipeline send", "s"), ("gradient traffic", "d")]
    ax.legend([Patch(color=colors[k]) for _, k in legend], [n for n, _ in legend], loc="upper right", fontsize=8)
    ax.set_yticks([2 * i for i in range(len(devices))], [f"stage {d}" for d in devices])
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(title or f"step {result.step_s:.4g} s, bubble {100 * result.bubble:.1f}%")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
