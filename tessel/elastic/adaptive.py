"""A rank's run across layouts: the world it starts in, and the layouts a slow rank makes it change to.

`run_layouts` is what each rank of `tessel train` runs (tessel.elastic.rank.train_rank):

    cfg for this world      an elastic world other than the recipe's is re-planned (fault.replan:
                            dp-only, or full: tessel.elastic.replan), falling back to full where dp-only cannot
    shares for the devices  dp_split / pp_balance "speed" (tessel.calibrate.speeds)
    mesh, model, runner     tessel.apply's steps (TP/SP -> CP -> EP -> PP -> fused loss -> recompute -> compile ->
                            DP/ZeRO), then Trainer.fit
    Relayout                fault.slow_policy named a slow rank; the trainer checkpointed and stopped:
      rebalance             the same ranks go on from that checkpoint in the rebalanced layout
      evict                 the slow rank's node leaves (its rank alone where it is the job's only
                            node: tessel.train.fault.slow.evicted_with); the others form a new process
                            group (regroup), re-plan for their number and devices and go on from the
                            checkpoint; the evicted ranks idle until they are done (park)

Nothing restarts: the processes stay, the model is built again and the
layout-independent checkpoint (weights, optimizer, data position, RNG) loads
into the new layout. An evicted rank returns None.
"""

from __future__ import annotations

import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tessel.apply import parallelize
from tessel.calibrate.speeds import resolve as resolve_speeds
from tessel.comm.topology import Topology
from tessel.config import Config, ConfigError, check_layout
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.models.emulated import emulate_device
from tessel.parallel.tensor_nd.apply import describe_mode
from tessel.runtime import job_store, make_deterministic
from tessel.elastic.dp_only import Replanned, replan_for_world
from tessel.train.fault.preempt import StopRequest
from tessel.train.fault.slow import Relayout, world_nodes
from tessel.train.trainer import Summary, Trainer

REGROUP_ENV = "TESSEL_REGROUP"  # how many times this job's ranks formed a new group without evicted ranks
# in the job's store: how many evicted ranks wait, how many have left, and that the ranks that went on are done
PARKED_KEY, LEFT_KEY, RELEASE_KEY = "tessel/evicted/parked", "tessel/evicted/left", "tessel/evicted/release"
PARK_POLL_S = 0.5
RELEASE_WAIT_POLLS = 10  # the most rank 0 waits for them to go: 5 s (one that died never does)


def run_layouts(cfg: Config, device: torch.device, run_id: str | None = None,
                stop: StopRequest | None = None) -> Summary | None:
    """Train cfg on the current process group, through every change of layout; None on an evicted rank."""
    replanned, evicted = None, False
    if cfg.runtime.elastic:
        cfg, replanned = relayout(cfg, device, run_id)
    try:
        while True:
            cfg = resolve_speeds(cfg, device, emulated_flops(cfg, dist.get_rank(), dist.get_world_size()))
            check_layout(cfg, world_size=dist.get_world_size())
            try:
                return fit_layout(cfg, device, run_id, stop, replanned)
            except Relayout as change:
                cfg, replanned = change.cfg.model_copy(deep=True), None
                cfg.checkpoint.resume = change.checkpoint
                if change.evict:
                    if not regroup(change.evict, cfg.runtime.timeout_s):
                        evicted = True
                        park(cfg.runtime.timeout_s, stop)
                        return None
                    cfg, replanned = relayout(without_ranks(cfg, change.evict), device, run_id)
    finally:
        if not evicted:  # done, stopped or failed: the evicted ranks need not wait any longer
            release_evicted(cfg.runtime.timeout_s)


def fit_layout(cfg: Config, device: torch.device, run_id: str | None, stop: StopRequest | None,
               replanned: Replanned | None) -> Summary:
    """The mesh, the model and the runner of cfg on this world, trained (Trainer.fit)."""
    p, r = cfg.parallel, cfg.runtime
    mesh = make_mesh(p.axis_sizes, order=p.rank_order, device=device)
    rank = dist.get_rank()
    if rank == 0:
        print(mesh.describe(), flush=True)
        if p.tp_mode != "1d" and p.tp > 1:  # the tp group's grid: which rank holds which block
            print(describe_mode(mesh, p.tp_mode, p.tp, p.tp_depth), flush=True)
    if r.topology and not r.nproc_per_node:  # a `tessel probe` file knows the node size
        mesh.check_topology(Topology.load(r.topology).nproc_per_node)
    else:
        mesh.check_topology(r.nproc_per_node)
    if cfg.train.deterministic:
        make_deterministic()
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank before any split
    model = build_model(cfg.model).to(device)
    flops = emulated_flops(cfg, rank, dist.get_world_size())
    if flops is not None:  # drills and tests: an emulated accelerator (tessel.models.emulated)
        emulate_device(model, flops)
    runner = parallelize(model, mesh, cfg)
    return Trainer(cfg, mesh, runner, rank, run_id=run_id, stop=stop, replanned=replanned).fit()


def emulated_flops(cfg: Config, rank: int, world: int) -> float | None:
    """This rank's emulated FLOP/s: runtime.emulate_flops x its runtime.device_speeds entry (None: a real device)."""
    r = cfg.runtime
    if r.emulate_flops is None:
        return None
    speeds = r.device_speeds if r.device_speeds is not None and len(r.device_speeds) == world else None
    return r.emulate_flops * (speeds[rank] if speeds else 1.0)


def relayout(cfg: Config, device: torch.device, run_id: str | None) -> tuple[Config, Replanned | None]:
    """cfg for the world it runs on, and the re-plan's report (None when the recipe's layout fits): dp
    re-divided (fault.replan = "dp-only"), or the whole layout chosen again (full; also where dp-only
    cannot divide the new world). Collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if cfg.parallel.world_size == world:
        return cfg, None
    if cfg.fault.replan == "dp-only":
        try:
            return with_nodes_of(cfg, *replan_for_world(cfg, world, rank, run_id))
        except ConfigError as err:
            if rank == 0:
                print(f"[tessel replan] dp-only cannot continue on {world} ranks ({err}): re-planning the whole "
                      "layout", flush=True)
    from tessel.elastic.replan import full_replan  # deferred: loads the probe, the profiler and the planner
    new, report = full_replan(cfg, device, run_id)
    if rank == 0:
        print("\n".join(report.lines()), flush=True)
    return with_nodes_of(cfg, new, report)


def with_nodes_of(old: Config, new: Config, report: Replanned | None) -> tuple[Config, Replanned | None]:
    """new with old's node size where it still describes the world: a re-plan clears it (after a resize the
    node size is torchrun's to say), but where whole nodes left, a later eviction needs it to find a node."""
    r = old.runtime
    if r.nproc_per_node and r.nnodes * r.nproc_per_node == new.parallel.world_size:
        new = new.model_copy(deep=True)
        new.runtime.nnodes, new.runtime.nproc_per_node = r.nnodes, r.nproc_per_node
    return new, report


def without_ranks(cfg: Config, evicted: list[int]) -> Config:
    """cfg's per-rank declarations without the evicted ranks' entries (the others are renumbered in order),
    and the node size of the ranks left where they fill whole nodes of one size."""
    new = cfg.model_copy(deep=True)
    r = new.runtime
    if r.device_speeds is not None:
        r.device_speeds = [s for i, s in enumerate(r.device_speeds) if i not in evicted]
    if r.device_memory_gib is not None:
        r.device_memory_gib = [m for i, m in enumerate(r.device_memory_gib) if i not in evicted]
    left = [n for n in world_nodes(cfg, cfg.parallel.world_size) if not set(n) & set(evicted)]
    whole = len({len(n) for n in left}) == 1 and sum(map(len, left)) == cfg.parallel.world_size - len(evicted)
    r.topology = None  # its rank numbers are the old world's
    r.nnodes, r.nproc_per_node = (len(left), len(left[0])) if whole else (1, None)
    return new


def regroup(evicted: list[int], timeout_s: float) -> bool:
    """A new default process group of the ranks that stay, renumbered in order; False on an evicted rank.

    Every rank leaves the old group; the ones that stay rendezvous again in the
    job's store (tessel.runtime.job_store: torchrun's agent's, or rank 0's under
    tessel.spawn, which must then stay), under a prefix of their own. An
    evicted rank joins a group of its own, so that its teardown finds one.
    """
    backend, rank, world = dist.get_backend(), dist.get_rank(), dist.get_world_size()
    stay = [r for r in range(world) if r not in evicted]
    dist.barrier()
    dist.destroy_process_group()
    os.environ.setdefault("TESSEL_LAUNCH_RANK", str(rank))  # drills' faults stay with this process
    generation = int(os.environ.get(REGROUP_ENV, "0")) + 1
    os.environ[REGROUP_ENV] = str(generation)  # heartbeats and later regroups key their store entries by it
    timeout = timedelta(seconds=timeout_s)
    if rank in evicted:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        print(f"[tessel slow] rank {rank} evicted: no more work, idle until the others finish", flush=True)
        return False
    new_rank = stay.index(rank)
    store = dist.PrefixStore(f"tessel/regroup{generation}", job_store(timeout_s))
    dist.init_process_group(backend, store=store, rank=new_rank, world_size=len(stay), timeout=timeout)
    os.environ.update(RANK=str(new_rank), WORLD_SIZE=str(len(stay)))
    return True


def park(timeout_s: float, stop: StopRequest | None) -> None:
    """An evicted rank does no more work but stays until the ranks that went on are done (release_evicted),
    the job's store is gone, or the run is told to stop. It may host that store (tessel.spawn's rank 0), and
    under torchrun its agent would only wait at its exit barrier (300 s), then leave, taking a rendezvous
    store it hosts with it."""
    store = job_store(timeout_s)
    store.add(PARKED_KEY, 1)
    try:
        while stop is None or not stop.pending():
            if store.check([RELEASE_KEY]):
                break
            time.sleep(PARK_POLL_S)
        store.add(LEFT_KEY, 1)
    except RuntimeError:  # (torch.distributed.DistError) the store is gone: so is the job
        pass


def release_evicted(timeout_s: float) -> None:
    """Rank 0 of the ranks that went on after an eviction tells the evicted ones (park) they may leave, and
    gives them a moment to go before this process, which may host the job's store, ends."""
    if os.environ.get(REGROUP_ENV) is None or not dist.is_initialized() or dist.get_rank() != 0:
        return
    try:
        store = job_store(timeout_s)
        store.set(RELEASE_KEY, "1")
        for _ in range(RELEASE_WAIT_POLLS):
            if store.add(LEFT_KEY, 0) >= store.add(PARKED_KEY, 0):
                return
            time.sleep(PARK_POLL_S)
    except RuntimeError:  # (DistError) the store is gone, the job is ending: nobody is waiting
        pass
