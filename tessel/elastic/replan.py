"""The full re-plan (fault.replan = "full"): a run that resumes on another world gets its whole layout chosen again.

A node is lost, the job is resized, ranks are evicted: the ranks now sit in
other places and the recipe's layout may no longer fit them (dp-only keeps tp
and pp, and cannot continue at all when tp*pp*ep does not divide the new
world). Every rank of the new world calls `full_replan` before it builds its
model; collectively they

1. probe the links, every pair once with small messages (tessel.calibrate.
   topology_probe.measure: well under a second on a handful of ranks); which
   ranks share a node comes from torchrun (GROUP_RANK), else all share one;
2. report their devices (kind, matmul speed, an emulated device's speed, the
   memory each may hold) and profile the model on these ranks
   (tessel.calibrate.profile.profile_ranks) unless a profile of the same
   model on the same devices is cached: the devices changed, so it re-profiles;
3. on rank 0, the planner (tessel.planner.search) ranks every layout of the
   new world at the recipe's global batch that fits the memory each rank has,
   and the first one tessel.config accepts is taken: dp, tp, pp, ep, the ZeRO
   stage, micro-batches, grad_accum, the schedule and its virtual stages,
   sequence parallelism, recompute. Ranks are mapped onto the nodes by the
   mesh's order (tp innermost, inside a node: the planner only offers tp
   groups that fit in one);
4. rank 0 broadcasts its choice, so every rank runs the same config.

What may not change: the model, the global batch, the sequence length, the
seed, the precision, the data, the optimizer's hyper-parameters and ZeRO's
parameter dtype (a checkpoint's trajectory continues). The layout-independent
checkpoint (weights, optimizer, data position, RNG) then loads into the new
layout as into any other (tessel.train.checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import replace

import torch
import torch.distributed as dist

from tessel.calibrate.cache import cache_path, cached_probe
from tessel.calibrate.device import device_budget
from tessel.calibrate.profile import calibration, profile_ranks, profiled_tp_degrees, summarize_profile
from tessel.calibrate.topology_probe import measure
from tessel.config import Config, ConfigError, check_layout, compute_dtype
from tessel.observe.metrics import measure_matmul_flops
from tessel.planner.cluster import Cluster, Link
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.fit import Budget
from tessel.planner.hetero import Gain, layer_capacity, min_per_coord, priced
from tessel.planner.layout import config_layout, layout_config
from tessel.planner.model_spec import from_config
from tessel.planner.search import MICRO_BATCHES, search, simulated
from tessel.elastic.dp_only import Previous, Replanned, previous_attempt, replan

PROBE_BYTES = 1 << 20  # a link's bandwidth from 1 MiB messages: enough to see 1 Gbit/s from loopback
PROFILE_ROUNDS = 3


def full_replan(cfg: Config, device: torch.device, run_id: str | None = None) -> tuple[Config, Replanned]:
    """The config this world runs, chosen by the planner, and its report. Collective over the world."""
    t0 = time.perf_counter()
    world, rank = dist.get_world_size(), dist.get_rank()
    cluster = probe_world(cfg, device)
    t_probe = time.perf_counter() - t0
    cal, profiled = profile_world(cfg, device, cluster)
    if rank == 0:
        try:
            new, report = choose(cfg, world, cluster, cal, previous_attempt(cfg, run_id))
            report.notes.append(f"chosen in {time.perf_counter() - t0:.1f} s: links probed in {t_probe:.1f} s, "
                                f"model {'profiled on these ranks' if profiled else 'profile cached for these devices'}")
            message = [new.model_dump_json(), report]
        except ConfigError as err:
            message = [None, str(err)]
    else:
        message = [None, None]
    dist.broadcast_object_list(message, src=0)
    if message[0] is None:
        raise ConfigError("fault.replan", f"no layout of {world} ranks: {message[1]}")
    new = Config.model_validate_json(message[0])
    check_layout(new, world_size=world)
    return new, message[1]


# ---- 1 and 2: what this world is -------------------------------------------------------------------
def probe_world(cfg: Config, device: torch.device) -> Cluster:
    """The planner's Cluster of the ranks that run now: links measured, devices reported. Collective."""
    world = dist.get_world_size()
    bw, lat = measure(PROBE_BYTES, reps=2, lat_reps=5, device=device)
    me = {"node": int(os.environ.get("GROUP_RANK", 0)), "kind": _device_kind(device),
          "fp32": measure_matmul_flops(device, torch.float32, seconds=0.1),
          "bf16": measure_matmul_flops(device, torch.bfloat16, seconds=0.1),
          "memory": _memory(cfg, dist.get_rank(), world)}
    ranks: list = [None] * world
    dist.all_gather_object(ranks, me)
    return world_cluster(ranks, bw, lat, cfg.runtime.emulate_flops, rank_speeds(cfg, ranks))


def _memory(cfg: Config, rank: int, world: int) -> Budget:
    """What this rank may hold: its runtime.device_memory_gib entry where declared (and less than the device
    offers), else what the device offers each of its node's ranks."""
    budget = device_budget(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))
    declared = cfg.runtime.device_memory_gib
    if declared is None or len(declared) != world or declared[rank] * 2**30 >= budget.per_rank:
        return budget
    return replace(budget, per_rank=declared[rank] * 2**30, text=f"{declared[rank]:g} GiB declared for this rank")


def rank_speeds(cfg: Config, ranks: list[dict]) -> tuple[float, ...]:
    """Each rank's speed relative to the device the model's profile prices (speed 1), in rank order; () where
    the ranks are alike.

    Declared (runtime.device_speeds, one per rank of this world): on emulated devices relative to
    runtime.emulate_flops, which the profile runs at; on real ones relative to the slowest rank, whose time
    the profile takes (tessel.calibrate.profile). Undeclared, devices of one kind are taken as alike (a
    matmul timed on a shared machine differs by its noise, not by the device); of different kinds, as
    fast as their measured matmuls, relative to the slowest.
    """
    declared = cfg.runtime.device_speeds
    if declared is not None and len(declared) == len(ranks):
        speeds = list(declared) if cfg.runtime.emulate_flops else [v / min(declared) for v in declared]
    elif len({info["kind"] for info in ranks}) > 1:
        key = compute_dtype(cfg.train.precision)
        speeds = [info[key] / min(i[key] for i in ranks) for info in ranks]
    else:
        return ()
    return () if all(v == 1 for v in speeds) else tuple(speeds)


def _device_kind(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def world_cluster(ranks: list[dict], bw: list[list[float]], lat: list[list[float]],
                  emulate_flops: float | None = None, speeds: tuple[float, ...] = ()) -> Cluster:
    """The Cluster of per-rank reports (node, kind, matmul FLOP/s, memory Budget) and the probe's matrices
    (Gbit/s, one-way us), its devices of these relative speeds (rank_speeds; () alike). Nodes must hold the
    same number of ranks (torchrun starts them so)."""
    nodes: dict[int, list[int]] = {}
    for r, info in enumerate(ranks):
        nodes.setdefault(info["node"], []).append(r)
    per_node = min(len(n) for n in nodes.values())
    node_of = {r: k for k, rs in enumerate(nodes.values()) for r in rs}
    n = len(ranks)
    pairs = [(i, j) for i in range(n) for j in range(n) if i != j]
    intra = _link([(bw[i][j], lat[i][j]) for i, j in pairs if node_of[i] == node_of[j]])
    inter = _link([(bw[i][j], lat[i][j]) for i, j in pairs if node_of[i] != node_of[j]]) or intra
    intra = intra or inter or Link(1e12, 0.0)
    budget = min((info["memory"] for info in ranks), key=lambda b: b.per_rank)
    # every layout is priced on the slowest rank's device, then on each rank's speed (choose, planner.hetero)
    flops = {dt: min(info[dt] for info in ranks) for dt in ("fp32", "bf16")}
    cpu = all(info["kind"] == "cpu" for info in ranks)
    probed = cached_probe(n) if cpu and len(nodes) == 1 else None  # this machine's collective fits, if measured
    return Cluster("this", len(nodes), per_node, flops, budget.per_rank, intra, inter, mem_bandwidth=1e10,
                   baseline_memory=budget.baseline, overlap=(probed.overlap if probed else 0.0) if cpu else 1.0,
                   usable_memory=0.8, source="probe", collectives=probed.collectives if probed else {},
                   collective_workspace=dict(budget.workspace), speeds=tuple(speeds),
                   extra={"devices": sorted({info["kind"] for info in ranks}), "emulate_flops": emulate_flops,
                          "nodes": [len(rs) for rs in nodes.values()]})


def _link(samples: list[tuple[float, float]]) -> Link | None:
    """Median bandwidth (Gbit/s -> bytes/s) and latency (us -> s) of some pairs; None for no pair."""
    if not samples:
        return None
    return Link(statistics.median(b for b, _ in samples) * 1e9 / 8, statistics.median(t for _, t in samples) / 1e6)


def profile_world(cfg: Config, device: torch.device, cluster: Cluster):
    """(the model's Calibration on these ranks, whether it was measured now). Cached by model and devices:
    the same model on the same kinds of devices and nodes is not profiled again. Collective."""
    world = dist.get_world_size()
    gb = cfg.train.global_batch
    mbs = [b for b in MICRO_BATCHES if gb % b == 0]  # the micro-batch sizes some layout of this batch can use
    tps = [t for t in profiled_tp_degrees(cfg.model, world) if t <= cluster.devices_per_node]
    raw = cfg.model.model_dump(exclude_none=True)
    raw.pop("init_from", None)
    key = hashlib.sha1(json.dumps([raw, cfg.train.seq_len, mbs, cfg.train.precision, tps, cluster.extra, "r1"],
                                  sort_keys=True).encode()).hexdigest()[:12]
    path = cache_path("replan-profile", key)
    cached = [path.exists()]
    dist.broadcast_object_list(cached, src=0)  # rank 0's cache decides for all: they profile together
    if cached[0]:
        return calibration(json.loads(path.read_text())), False
    mine = profile_ranks(cfg.model, cfg.train.seq_len, mbs, cfg.train.precision, tps, PROFILE_ROUNDS,
                         emulate_flops=cfg.runtime.emulate_flops)
    results: list = [None] * world
    dist.all_gather_object(results, mine)
    d = summarize_profile(results, tps)
    if dist.get_rank() == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(d, indent=1))
        os.replace(tmp, path)
    return calibration(d), True


# ---- 3: the choice ---------------------------------------------------------------------------------
def replan_base(cfg: Config) -> Config:
    """cfg with what the layout search re-chooses cleared: the stage cut, the grid mode, the node size."""
    base = cfg.model_copy(deep=True)
    base.parallel.pp_layout, base.parallel.dp_shares = None, None
    base.parallel.tp_mode, base.parallel.tp_depth = "1d", 1
    base.runtime.nproc_per_node, base.runtime.topology = None, None
    return base


def choose(cfg: Config, world: int, cluster: Cluster, cal, old: Previous) -> tuple[Config, Replanned]:
    """The planner's fastest layout of `world` ranks that tessel.config accepts, and the report. On devices of
    different speeds (cluster.speeds) every layout is priced again on them, split evenly and, where the
    runtime can, in proportion to speed (tessel.planner.hetero.priced), and the fastest of those is taken."""
    spec = from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch)
    cm = CostModel(spec, cluster, cfg.train.precision, cal, cfg.parallel.bucket_mb, cfg.parallel.zero_reduce_dtype,
                   compiled=cfg.train.compile != "off", fused_loss=cfg.train.fused_loss)
    fixed = {"zero_param_dtype": "bf16"} if cfg.parallel.zero_param_dtype == "bf16" else None
    result = search(cm, world, cfg.train.global_batch, fixed)
    base = replan_base(cfg)
    if cluster.speeds and cfg.runtime.device_speeds is None:  # measured: the runtime splits by the same
        base.runtime.device_speeds = list(cluster.speeds)
    options = []  # (step on these devices, the planner's rank, config, the hetero prices)
    for i, est in enumerate(result.ranked):
        option = _on_devices(base, est, cluster, world) if cluster.speeds else _as_planned(base, est)
        if option is not None:
            options.append((option[1], i, option[0], option[2]))
            if not cluster.speeds:  # alike: the planner's order stands, its first runnable layout wins
                break
    if not options:
        raise ConfigError("fault.replan", f"none of the {len(result.ranked)} layouts that fit {world} ranks is "
                          "one tessel.config accepts for this recipe")
    step_s, i, new, prices = min(options, key=lambda o: o[:2])  # ties: the planner's order
    report = Replanned("full", old, world, _describe(new), step_s)
    report.alternative, report.alternative_s = _dp_only(cfg, world, cm)
    report.notes.append(_cluster_note(cluster))
    if prices is not None:
        report.notes.append(_devices_note(cluster, prices))
    report.notes.append(f"planner: {result.evaluated} layouts, {len(result.ranked)} fit; took #{i + 1}"
                        + (" of them priced on these devices" if cluster.speeds else ""))
    return new, report


def _as_planned(base: Config, est: Estimate) -> tuple[Config, float, None] | None:
    """est's layout as a config, at the planner's price (devices alike); None where tessel.config refuses it."""
    lay = est.layout
    if lay.pp > 1 or lay.ep > 1 or lay.zero_stage > 1:  # a recipe's dp split by speed, where the layout cannot split
        base = base.model_copy(deep=True)
        base.parallel.dp_split = "even"
    try:
        return layout_config(base, lay), est.step_s, None
    except ConfigError:  # the planner prices layouts the runtime does not run (yet) with this recipe
        return None


def _on_devices(base: Config, est: Estimate, cluster: Cluster, world: int) -> tuple[Config, float, Gain] | None:
    """est's layout as a config on devices of cluster.speeds, and its step there: the split in proportion to
    speed where it is faster and the runtime runs it (dp_split or pp_balance "speed"), else the even split."""
    lay = est.layout
    try:
        even = layout_config(_split(base, "even"), lay)
    except ConfigError:
        return None
    memory = base.runtime.device_memory_gib
    memory = [m * 2**30 for m in memory] if memory and len(memory) == world else [cluster.memory] * world
    order = even.parallel.rank_order
    capacity = (layer_capacity(even, min_per_coord(memory, lay.axis_sizes, order, "pp"), cluster.baseline_memory)
                if lay.pp > 1 and lay.virtual_stages == 1 else None)
    try:
        prices = priced(est, list(cluster.speeds), base.model.n_layer, capacity, order)
    except ConfigError:  # the stages' memory cannot hold the blocks
        return None
    if prices.uneven_s < prices.even_s:
        try:
            return layout_config(_split(base, "speed", lay.pp > 1), lay), prices.uneven_s, prices
        except ConfigError:  # this layout's uneven split is not one the runtime runs
            pass
    return even, prices.even_s, replace(prices, uneven_s=prices.even_s, split=[])


def _split(base: Config, how: str, pipeline: bool = False) -> Config:
    """base with the work shared evenly, or in proportion to speed: the dp ranks' micro-batches, or (pipeline)
    the stages' blocks."""
    new = base.model_copy(deep=True)
    p = new.parallel
    p.dp_split = "speed" if how == "speed" and not pipeline else "even"
    if how == "speed" and pipeline:
        p.pp_balance = "speed"
    elif p.pp_balance == "speed":
        p.pp_balance = "layers"
    return new


def _describe(cfg: Config) -> str:
    """The layout, and how its work is shared where not evenly."""
    p = cfg.parallel
    split = " dp by speed" if p.dp_split == "speed" else " pp by speed" if p.pp_balance == "speed" else ""
    return config_layout(cfg).describe() + split


def _devices_note(cluster: Cluster, prices: Gain) -> str:
    speeds = ", ".join(f"{s:g}" for s in cluster.speeds)
    if not prices.split:  # alike, or no split in proportion runs with this layout or is faster
        return f"devices of speeds {speeds}: split evenly, {prices.even_s:.4g} s/step"
    kind = "micro-batches per dp rank" if prices.what == "dp" else "blocks per stage"
    return (f"devices of speeds {speeds}: split evenly {prices.even_s:.4g} s/step, in proportion to speed "
            f"{prices.uneven_s:.4g} s/step ({kind} {prices.split})")


def _dp_only(cfg: Config, world: int, cm: CostModel) -> tuple[str | None, float | None]:
    """The layout dp-only would have run, and its predicted step time (None where it cannot run), on these
    devices where their speeds differ (its split as the recipe's dp_split says, where the layout allows)."""
    try:
        kept = replan(cfg, world)
    except ConfigError:
        return "nothing (tp*pp*ep does not divide the new world)", None
    lay = config_layout(kept)
    est: Estimate = simulated([cm.estimate(lay)])[0]
    if not cm.cluster.speeds:
        return lay.describe(), est.step_s
    prices = priced(est, list(cm.cluster.speeds), cfg.model.n_layer, order=kept.parallel.rank_order)
    by_speed = kept.parallel.dp_split == "speed" and lay.pp == 1 and lay.ep == 1 and lay.zero_stage <= 1
    return _describe(kept), prices.uneven_s if by_speed else prices.even_s


def _link_text(link: Link) -> str:
    return f"{8 * link.bandwidth / 1e9:.3g} Gbit/s, {1e6 * link.latency:.0f} us"


def _cluster_note(c: Cluster) -> str:
    links = f"intra-node {_link_text(c.intra)}" + (f", inter-node {_link_text(c.inter)}" if c.nodes > 1 else "")
    emulated = f", emulated at {c.extra['emulate_flops']:.3g} FLOP/s" if c.extra.get("emulate_flops") else ""
    return (f"world: {c.nodes} node(s) x {c.devices_per_node} ranks ({', '.join(c.extra['devices'])}{emulated}); "
            f"links: {links}; {c.memory / 2**30:.1f} GiB per rank")
