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

import torch
import torch.distributed as dist

from tessel.calibrate.cache import cache_path, cached_probe
from tessel.calibrate.device import device_budget
from tessel.calibrate.profile import calibration, profile_ranks, profiled_tp_degrees, summarize_profile
from tessel.calibrate.topology_probe import measure
from tessel.config import Config, ConfigError, check_layout
from tessel.observe.metrics import measure_matmul_flops
from tessel.planner.cluster import Cluster, Link
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.layout import config_layout, layout_config
from tessel.planner.model_spec import from_config
from tessel.planner.search import MICRO_BATCHES, search, simulated
from tessel.train.fault.elastic import Previous, Replanned, previous_attempt, replan

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
          "memory": device_budget(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world)))}
    ranks: list = [None] * world
    dist.all_gather_object(ranks, me)
    return world_cluster(ranks, bw, lat, cfg.runtime.emulate_flops)


def _device_kind(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def world_cluster(ranks: list[dict], bw: list[list[float]], lat: list[list[float]],
                  emulate_flops: float | None = None) -> Cluster:
    """The Cluster of per-rank reports (node, kind, matmul FLOP/s, memory Budget) and the probe's matrices
    (Gbit/s, one-way us). Nodes must hold the same number of ranks (torchrun starts them so)."""
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
    # the slowest rank sets every layout's pace (a heterogeneous split is the planner's hetero pass)
    flops = {dt: min(info[dt] for info in ranks) for dt in ("fp32", "bf16")}
    cpu = all(info["kind"] == "cpu" for info in ranks)
    probed = cached_probe(n) if cpu and len(nodes) == 1 else None  # this machine's collective fits, if measured
    return Cluster("this", len(nodes), per_node, flops, budget.per_rank, intra, inter, mem_bandwidth=1e10,
                   baseline_memory=budget.baseline, overlap=(probed.overlap if probed else 0.0) if cpu else 1.0,
                   usable_memory=0.8, source="probe", collectives=probed.collectives if probed else {},
                   collective_workspace=dict(budget.workspace),
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
    """The planner's fastest layout of `world` ranks that tessel.config accepts, and the report."""
    spec = from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch)
    cm = CostModel(spec, cluster, cfg.train.precision, cal, cfg.parallel.bucket_mb, cfg.parallel.zero_reduce_dtype)
    fixed = {"param_dtype": "bf16"} if cfg.parallel.zero_param_dtype == "bf16" else None
    result = search(cm, world, cfg.train.global_batch, fixed)
    base = replan_base(cfg)
    even = base.model_copy(deep=True)
    even.parallel.dp_split = "even"  # a recipe's dp split by speed, where the layout cannot split unevenly
    for est in result.ranked:
        lay = est.layout
        try:
            new = layout_config(base if lay.pp == 1 and lay.ep == 1 and lay.zero <= 1 else even, lay)
        except ConfigError:
            continue  # the planner prices layouts the runtime does not run (yet) with this recipe
        report = Replanned("full", old, world, est.layout.describe(), est.step_s)
        report.alternative, report.alternative_s = _dp_only(cfg, world, cm)
        report.notes.append(_cluster_note(cluster))
        report.notes.append(f"planner: {result.evaluated} layouts, {len(result.ranked)} fit; "
                            f"took #{result.ranked.index(est) + 1}")
        return new, report
    raise ConfigError("fault.replan", f"none of the {len(result.ranked)} layouts that fit {world} ranks is one "
                      "tessel.config accepts for this recipe")


def _dp_only(cfg: Config, world: int, cm: CostModel) -> tuple[str | None, float | None]:
    """The layout dp-only would have run, and its predicted step time (None where it cannot run)."""
    try:
        lay = config_layout(replan(cfg, world))
    except ConfigError:
        return "nothing (tp*pp*ep does not divide the new world)", None
    est: Estimate = simulated([cm.estimate(lay)])[0]
    return lay.describe(), est.step_s


def _link_text(link: Link) -> str:
    return f"{8 * link.bandwidth / 1e9:.3g} Gbit/s, {1e6 * link.latency:.0f} us"


def _cluster_note(c: Cluster) -> str:
    links = f"intra-node {_link_text(c.intra)}" + (f", inter-node {_link_text(c.inter)}" if c.nodes > 1 else "")
    emulated = f", emulated at {c.extra['emulate_flops']:.3g} FLOP/s" if c.extra.get("emulate_flops") else ""
    return (f"world: {c.nodes} node(s) x {c.devices_per_node} ranks ({', '.join(c.extra['devices'])}{emulated}); "
            f"links: {links}; {c.memory / 2**30:.1f} GiB per rank")
