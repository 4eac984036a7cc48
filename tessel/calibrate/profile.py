"""Measure "this machine" and profile the reference model on it: the planner's calibration.

Two measurements, both cached as JSON under the tessel cache directory:

- `probe_this(world)`: `world` ranks started with tessel.spawn.spawn, all
  measuring at once (so cores shared by several ranks are priced as they are
  shared): matmul FLOP/s per rank with one thread (fp32, bf16), gloo
  all-reduce latency and bandwidth, a fit alpha + beta * bytes for each
  collective the trainer uses (all-reduce, all-gather, reduce-scatter,
  all-to-all, p2p) and each group size, how much of an all-reduce hides behind
  concurrent compute, memory bandwidth, and the resident memory a rank holds
  before it holds any model (Python, torch, gloo, the trainer's modules).
- `profile_model(model, seq_len, world, ...)`: the same ranks time forward +
  backward of the recipe's model (tessel.models.build.build_model: the
  reference GPT or a Hugging Face model) at several micro-batch sizes, whole
  and, for the reference GPT, as one rank of each tensor-parallel degree holds
  it (with and without its collectives), the clipped AdamW step, and the
  trainer's per-step bookkeeping. A Hugging Face model is timed whole; the
  cost model prices its tp ranks from those times (Calibration.flops_at).

Nothing here is fitted to published numbers: every constant is a stopwatch
reading on this machine. Importing this module loads torch and the trainer's
modules (the ranks run them); tessel.commands.planning imports it only to plan for the
cluster "this", and reading a cached probe needs only tessel.calibrate.cache.
"""

from __future__ import annotations

import hashlib
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.distributed as dist

from tessel.calibrate.cache import cache_path, probe_path
from tessel.config import ModelConfig, TrainConfig
from tessel.models.build import build_model
from tessel.models.emulated import emulate_device
from tessel.models.gpt import GPT, cross_entropy
from tessel.models.moe import MoE
from tessel.models.plan import gpt_tp_plan
from tessel.observe.metrics import measure_matmul_flops
from tessel.parallel.runner import autocast_for
from tessel.parallel.tensor.comm import _all_gather_single, _reduce_scatter_single
from tessel.parallel.tensor.tensor_parallel import TPContext, VocabParallelLoss, apply_plan
from tessel.planner.cluster import Cluster, Link
from tessel.planner.calibration import Calibration
from tessel.planner.model_spec import ModelSpec
from tessel.planner.search import tp_degrees
from tessel.planner.traffic import fit_alpha_beta
from tessel.spawn import spawn
from tessel.train.data import BatchSampler
from tessel.train.optim import build_optimizer


def _median_time(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _rss_bytes() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss if sys.platform == "darwin" else rss * 1024


def _own_session() -> None:
    """Run this rank in its own session, as torchrun does (start_new_session=True).

    Linux's autogroup scheduler (kernel.sched_autogroup_enabled) shares the
    CPU fairly between sessions, not processes. Ranks spawned into the
    parent's session split one share among themselves, while `tessel train`'s
    ranks get one share each: on a loaded machine the probe would then see
    several times less CPU than the trainer it is meant to predict.
    """
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader


def _probe_rank() -> dict:
    _own_session()
    # what a rank of `tessel train` holds besides this module: its command line and the trainer
    import typer  # noqa: F401  # deferred: loaded for its resident memory, part of the baseline measured below

    import tessel.train.trainer  # noqa: F401  # deferred: the same (its checkpoints, guard, metrics)

    n = dist.get_world_size()
    dist.barrier()
    baseline = _baseline_rss()  # first, before the probe's own buffers raise the peak
    workspace = collective_workspace()  # before other collectives warm the allocator up
    out = {"baseline": baseline, "workspace": workspace,
           "fp32": measure_matmul_flops(torch.device("cpu"), torch.float32),
           "bf16": measure_matmul_flops(torch.device("cpu"), torch.bfloat16)}
    small, big = torch.zeros(1), torch.zeros(2**20)  # 4 B and 4 MiB
    dist.all_reduce(big)
    dist.barrier()
    t_small = _median_time(lambda: dist.all_reduce(small), 30)
    dist.barrier()
    t_big = _median_time(lambda: dist.all_reduce(big), 7)
    alpha = t_small / max(1, 2 * (n - 1))
    beta_time = max(t_big - 2 * (n - 1) * alpha, 1e-9)
    out["latency"] = alpha
    out["bandwidth"] = 2 * (n - 1) / n * big.numel() * 4 / beta_time if n > 1 else float("inf")
    out["overlap"] = _overlap(big, n)
    out["collectives"] = {**_collective_points(n), **_p2p_under_load(n)}
    a = torch.empty(2**23)  # 32 MiB: streams through memory, like the optimizer step
    out["mem_bandwidth"] = 3 * a.numel() * 4 / _median_time(lambda: a.mul_(1.0000001).add_(1e-9), 5)
    return out


# sizes of the collective probe: a TP activation of one micro-batch is 16 KiB-1 MiB here,
# a gradient bucket 1-25 MiB; the smallest shows the per-call cost alone
PROBE_BYTES = (64, 16 * 2**10, 256 * 2**10, 4 * 2**20)


def _collective_points(n: int) -> dict[str, list[tuple[float, float]]]:
    """{"op/group size": [(bytes, median seconds)]} for every op of tessel.planner.traffic.

    Every group size g dividing the world is timed with all n/g groups busy at
    once (contiguous ranks, as tp groups are laid out): the cores are shared
    as they are when every tp group of a layout communicates. p2p is one
    batched isend/irecv between the ranks of a pair, half a ping-pong.
    """
    out = {}
    for g in [g for g in range(2, n + 1) if n % g == 0]:
        group, me = _contiguous_group(g)

        def p2p(buf, group=group, me=me):
            peer = dist.get_global_rank(group, 1 - me)
            for sender in (0, 1):
                op = dist.isend if me == sender else dist.irecv
                for w in dist.batch_isend_irecv([dist.P2POp(op, buf, peer, group=group)]):
                    w.wait()
        for nbytes in PROBE_BYTES:
            numel = max(g, nbytes // 4 // g * g)
            x, big = torch.ones(numel), torch.ones(numel * g)
            part = torch.empty(numel // g)
            calls = {"all_reduce": lambda: dist.all_reduce(x, group=group),
                     "all_gather": lambda: _all_gather_single(big, x, group=group),
                     "reduce_scatter": lambda: _reduce_scatter_single(part, x, group=group),
                     "all_to_all": lambda: dist.all_to_all_single(big[:numel], x, group=group)}
            if g == 2:
                calls["p2p"] = lambda: p2p(x)
            sizes = {"all_gather": numel * g * 4}  # all_gather is priced by its gathered output
            reps = 15 if nbytes <= 2**16 else (7 if nbytes <= 2**20 else 4)
            for op, fn in calls.items():
                fn()  # warm-up: connection set-up, allocations
                dist.barrier()
                t = _median_time(fn, reps) / (2 if op == "p2p" else 1)
                out.setdefault(f"{op}/{g}", []).append((sizes.get(op, numel * 4), t))
    return out


HANDOFF_ROUNDS = 12


def _p2p_under_load(n: int) -> dict[str, list[tuple[float, float]]]:
    """{"p2p_loaded/2": [(bytes, seconds)]}: what a pipeline's hand-off costs on this machine, measured as a
    pipeline hands off: ranks in pairs (2k, 2k+1), all pairs at once, each rank computing between
    messages and waiting for its peer's, in lockstep (as interleaved stages run).

    With more ranks than cores, a rank that blocked on its message gave up its core; when the message lands
    it waits for the scheduler to hand a core back from a rank that is computing, and a rank that computes
    as much as the others has no credit to take it at once: it waits out a time slice. An idle ping-pong
    (the collective probe above) never sees that. Per message: half a round less one compute, the compute
    timed with the same ranks computing at once (each pair's other rank waiting, as in the lockstep).
    Every rank gets the median over pairs.
    """
    me = dist.get_rank()
    if n < 2 or n % 2:
        return {}
    peer, first = me ^ 1, me % 2 == 0
    a = torch.randn(192, 192)

    def compute():  # a few ms: a block's worth of work on this tiny model's scale
        for _ in range(12):
            a @ a
    compute()
    points = []
    for nbytes in PROBE_BYTES[:3]:  # up to a micro-batch's activation here
        x = torch.ones(max(1, nbytes // 4))
        go = torch.zeros(1)

        def hop(send_first: bool) -> None:
            if send_first:
                compute()
                dist.send(x, peer)
                dist.recv(x, peer)
            else:
                dist.recv(x, peer)
                compute()
                dist.send(x, peer)
        hop(first)  # warm-up
        dist.barrier()
        t_round = _median_time(lambda: hop(first), HANDOFF_ROUNDS)
        dist.barrier()
        # one rank of each pair computes while the other waits: the lockstep's load, without hand-offs
        if first:
            t_compute = _median_time(compute, HANDOFF_ROUNDS)
            dist.send(go, peer)
        else:
            dist.recv(go, peer)
            t_compute = 0.0
        points.append((x.numel() * 4, t_round, t_compute))
    # the median over pairs of each size's (round, compute): every rank gets the same points
    everyone: list = [None] * n
    dist.all_gather_object(everyone, points)
    out = []
    for i, (nbytes, _, _) in enumerate(points):
        rounds = statistics.median(everyone[r][i][1] for r in range(0, n, 2))
        computes = statistics.median(everyone[r][i][2] for r in range(0, n, 2))
        out.append((nbytes, max(rounds / 2 - computes, 1e-6)))
    return {"p2p_loaded/2": out}


def _overlap(buf, n: int) -> float:
    """Fraction of an all-reduce that hides behind concurrent matmuls (0: none, 1: all)."""
    if n == 1:
        return 1.0
    a = torch.randn(192, 192)

    def compute():
        for _ in range(40):
            a @ a
    t_c = _median_time(compute, 3)
    dist.barrier()
    t_m = _median_time(lambda: dist.all_reduce(buf), 3)
    dist.barrier()

    def both():
        work = dist.all_reduce(buf, async_op=True)
        compute()
        work.wait()
    t_b = _median_time(both, 3)
    hidden = t_c + t_m - t_b
    return max(0.0, min(1.0, hidden / min(t_c, t_m)))


WORKSPACE_BYTES = 16 * 2**20  # the size of a small model's flat buffers or of a gradient bucket


def _status_bytes(key: str) -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key):
                    return float(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def collective_workspace(nbytes: int = WORKSPACE_BYTES) -> dict[str, float]:
    """{op: peak host memory one call adds beyond its own buffers, per byte of its buffer}.

    gloo works on copies: a reduce-scatter copies its input, an all-gather
    stages its output (measured here at 4 ranks: about 1.0-1.35x and 1.0-2.5x,
    an all-reduce 0.13-0.25x). That is memory the trainer's peak RSS holds
    (ZeRO's publish all-gathers every parameter at once). Measured on each op's
    first call, as the trainer's first step meets it: the peak is reset
    (/proc/self/clear_refs "5") and read back (VmHWM). Empty where Linux's
    /proc does not say (the planner then adds nothing).
    """
    n = dist.get_world_size()
    numel = max(n, nbytes // 4 // n * n)
    full, part = torch.ones(numel), torch.ones(numel // n)
    # each op's buffer is `full`: the all-reduced tensor, the reduce-scatter's input, the gathered output
    calls = {"all_reduce": lambda: dist.all_reduce(full),
             "reduce_scatter": lambda: _reduce_scatter_single(part, full),
             "all_gather": lambda: _all_gather_single(full, part)}
    out = {}
    for op, fn in calls.items():
        dist.barrier()
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # reset the peak RSS (VmHWM) to the current RSS
        except OSError:
            return {}
        before = _status_bytes("VmRSS:")
        fn()
        after = _status_bytes("VmHWM:")
        if before is None or after is None:
            return {}
        out[op] = max(0.0, after - before) / (numel * 4)
    return out


def _baseline_rss() -> float:
    """Peak RSS after one training step of a negligible model: the runtime's own footprint."""
    model = GPT(ModelConfig(vocab_size=256, n_layer=1, n_head=2, d_model=8, max_seq_len=8))
    opt = build_optimizer(list(model.parameters()), TrainConfig())
    x = torch.randint(0, 256, (1, 8))
    cross_entropy(model(x), x).backward()
    opt.step()
    return _rss_bytes()


def probe_this(world: int, refresh: bool = False) -> Cluster:
    """The cluster "this": one node of `world` ranks on this machine, measured (cached)."""
    path = probe_path(world)
    if path.exists() and not refresh:
        return Cluster.from_dict(json.loads(path.read_text()))
    results = spawn(_probe_rank, world, timeout=300)
    med = {k: statistics.median(r[k] for r in results) for k in results[0] if k not in ("collectives", "workspace")}
    workspace = {op: statistics.median(r["workspace"].get(op, 0.0) for r in results)
                 for op in results[0]["workspace"]}
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    link = Link(med["bandwidth"], med["latency"])
    fits = {}
    for key in results[0]["collectives"]:  # the median over ranks of each point, then one fit per op
        pts = [(x, statistics.median(r["collectives"][key][i][1] for r in results))
               for i, (x, _) in enumerate(results[0]["collectives"][key])]
        fits[key] = list(fit_alpha_beta(pts))
    cluster = Cluster("this", 1, world, {"fp32": med["fp32"], "bf16": med["bf16"]}, ram / world, link, link,
                      mem_bandwidth=med["mem_bandwidth"], efficiency=1.0, baseline_memory=med["baseline"],
                      overlap=med["overlap"], usable_memory=0.8, source="probe", collectives=fits,
                      collective_workspace=workspace,
                      extra={"probed_at": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cluster.to_dict(), indent=1))
    return cluster


# ---- profiling the reference model --------------------------------------------

def _tp_shaped(model, cfg, tp: int, group=None, rank: int = 0):
    """The model as one tp rank holds it; with group None, the communication left out.

    tessel.parallel.tensor.tensor_parallel's layers shard by ctx.size and talk only when
    ctx.group is set: without a group this times exactly the matmuls (q, k, v,
    wo, gate, up, down, vocab head) and attention of 1/tp of the heads and
    columns that a tp rank runs, whose efficiency falls as the matrices
    shrink. With the rank's real tp group it is the layer as the trainer runs
    it, collectives included.
    """
    if tp == 1:
        return model, cross_entropy
    ctx = TPContext(group, tp, rank, False)
    moe_blocks = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    apply_plan(model, gpt_tp_plan(moe_blocks, cfg.n_layer), ctx)
    return model, VocabParallelLoss(ctx, cfg.vocab_size)


def _contiguous_group(size: int) -> tuple[object, int]:
    """(this rank's group of `size` consecutive ranks, as tp groups are laid out, its rank in it).

    Collective: every rank creates every group of the world's partition, in the same order."""
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(s, s + size))) for s in range(0, dist.get_world_size(), size)]
    return groups[rank // size], rank % size


def _profile_rank(model_raw: dict, seq_len: int, micro_batches: list[int], precision: str,
                  tp_sizes: list[int], rounds: int = 5) -> dict:
    _own_session()
    return profile_ranks(ModelConfig(**model_raw), seq_len, micro_batches, precision, tp_sizes, rounds)


def profile_ranks(cfg: ModelConfig, seq_len: int, micro_batches: list[int], precision: str, tp_sizes: list[int],
                  rounds: int = 5, emulate_flops: float | None = None) -> dict:
    """This rank's timings of the model (see profile_model); collective over the default group: the ranks
    spawned here, or a running job's own (tessel.elastic.replan). emulate_flops: the blocks run on an emulated
    device of that speed, as the job's do (tessel.models.emulated)."""
    spec = ModelSpec("profile", cfg, seq_len, 1)
    dev = torch.device("cpu")
    batches = {mb: torch.randint(0, cfg.vocab_size, (mb, seq_len)) for mb in micro_batches}
    groups = {tp: _contiguous_group(tp) for tp in tp_sizes if tp > 1}
    # (tp, with its collectives?) -> the model as one tp rank runs it
    models = {}
    for tp in tp_sizes:
        for real in ((False, True) if tp > 1 else (False,)):
            torch.manual_seed(0)
            models[tp, real] = _tp_shaped(build_model(cfg), cfg, tp, *(groups[tp] if real else (None, 0)))
            if emulate_flops is not None:
                emulate_device(models[tp, real][0], emulate_flops)

    def fwd_bwd(key, x):
        model, loss_fn = models[key]
        with autocast_for(dev, precision):
            loss = loss_fn(model(x), x)
        loss.backward()
    for key in models:
        for x in batches.values():
            fwd_bwd(key, x)  # warm-up: allocations and kernel choice
    # shapes take turns, round after round, so a change in the machine's load hits them all alike
    times: dict[tuple, list[float]] = {(key, mb): [] for key in models for mb in micro_batches}
    for _ in range(rounds):
        for key, mb in times:
            dist.barrier()
            times[key, mb].append(_slowest(_median_time(lambda: fwd_bwd(key, batches[mb]), 1)))
    med = {k: statistics.median(v) for k, v in times.items()}
    # whole-model FLOPs per second of one rank's time: a tp rank does 1/tp of them in that time
    points = {tp: [(mb * seq_len, spec.model_flops_per_token() * mb * seq_len / med[(tp, False), mb])
                   for mb in micro_batches] for tp in tp_sizes}
    # what the tp collectives add to a micro-batch's forward + backward, issued between the
    # matmuls as the trainer issues them (ranks that arrive apart wait for each other)
    tp_comm = {tp: [(mb * seq_len, med[(tp, True), mb] - med[(tp, False), mb]) for mb in micro_batches]
               for tp in tp_sizes if tp > 1}

    t_opt, t_over = _time_step_rest(models[1, False][0], seq_len, max(micro_batches))
    n_params = sum(p.numel() for p in models[1, False][0].parameters())
    return {"points": points, "tp_comm": tp_comm, "opt_s_per_param": t_opt / n_params, "overhead": t_over}


def _slowest(seconds: float) -> float:
    """The slowest rank's time of a round that started at a barrier: a synchronous step (its gradient
    all-reduce, a tp layer's collective, a pipeline's hand-off) ends when its slowest rank does, and on a
    host with fewer cores than ranks that is the unluckiest rank's descheduling, not the typical one's."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _time_step_rest(model, seq_len: int, mb: int) -> tuple[float, float]:
    """(clip + AdamW step, per-step bookkeeping) seconds of the whole model on this rank."""
    params = list(model.parameters())
    opt = build_optimizer(params, TrainConfig())

    def opt_step():
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=False)
    opt_step()
    dist.barrier()
    t_opt = _median_time(opt_step, 5)
    sampler = BatchSampler(torch.randint(0, 256, (100_000,)).numpy(), seq_len, mb, 0)
    scalar = torch.zeros(1)

    def bookkeeping():
        # what Trainer.train_step adds to any layout: the batch, the loss mean and the all-finite vote (the
        # gradient norm agrees on its reductions once, at the first step: tessel.parallel.norms)
        sampler.next()
        dist.all_reduce(scalar)
        dist.all_reduce(scalar)
    dist.barrier()
    return t_opt, _median_time(bookkeeping, 10)


def profiled_tp_degrees(model_cfg: ModelConfig, world: int) -> list[int]:
    """The tp degrees whose rank-local model is timed: every one tessel accepts for the reference GPT
    (tessel.models.plan cuts it here without the trainer); the whole model for a Hugging Face one."""
    return tp_degrees(model_cfg, world) if model_cfg.hf_config is None else [1]


def profile_model(model_cfg, seq_len: int, world: int, micro_batches: list[int], precision: str = "fp32",
                  refresh: bool = False) -> Calibration:
    """Time the reference GPT on `world` concurrent ranks at each micro-batch size (cached)."""
    raw = model_cfg.model_dump(exclude_none=True)
    raw.pop("init_from", None)  # timing needs the shapes, not the weights (nor a cache entry per weights file)
    tps = profiled_tp_degrees(model_cfg, world)
    key = hashlib.sha1(json.dumps([raw, seq_len, world, sorted(micro_batches), precision, tps, "v3"],
                                  sort_keys=True).encode()).hexdigest()[:12]
    path = cache_path("profile", key)
    if path.exists() and not refresh:
        d = json.loads(path.read_text())
    else:
        results = spawn(_profile_rank, world, raw, seq_len, sorted(micro_batches), precision, tps, timeout=600)
        d = summarize_profile(results, tps)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(d, indent=1))
    return calibration(d)


def summarize_profile(results: list[dict], tps: list[int]) -> dict:
    """Every rank's profile_ranks -> one profile (the median over ranks of each point), as JSON."""
    def across_ranks(field: str, tp) -> list[tuple[int, float]]:
        rows = [r[field][tp] for r in results]
        return [(x, statistics.median(row[i][1] for row in rows)) for i, (x, _) in enumerate(rows[0])]
    return {"points": {str(tp): across_ranks("points", tp) for tp in tps},
            "tp_comm": {str(tp): across_ranks("tp_comm", tp) for tp in tps if tp > 1},
            "opt_s_per_param": statistics.median(r["opt_s_per_param"] for r in results),
            "overhead": statistics.median(r["overhead"] for r in results)}


def calibration(d: dict) -> Calibration:
    """A profile's JSON (summarize_profile) as the cost model's Calibration."""
    tp_points = {int(tp): [tuple(p) for p in pts] for tp, pts in d["points"].items()}
    tp_comm = {int(tp): [tuple(p) for p in pts] for tp, pts in d["tp_comm"].items()}
    return Calibration(tp_points.get(1, []), d["opt_s_per_param"], d["overhead"], tp_points, tp_comm)
