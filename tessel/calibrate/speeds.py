"""Each rank's device speed and memory, for a split in proportion to speed (tessel.planner.hetero).

Declared (runtime.device_speeds, runtime.device_memory_gib: one entry per rank)
or measured at start: every rank times a forward and backward of one
micro-batch through the whole model as it would run it (on its emulated
device, where there is one), and speed is the inverse of that time, relative
to the fastest rank. Memory, where not declared, is what the device offers
each rank (tessel.calibrate.device). Collective: every rank calls `resolve`.
"""

from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from tessel.calibrate.device import device_budget
from tessel.config import Config
from tessel.models.build import build_model
from tessel.models.emulated import emulate_device
from tessel.models.gpt import cross_entropy
from tessel.observe.metrics import synced_seconds
from tessel.planner.hetero import layer_capacity, min_per_coord, with_speeds

REPS = 3


def rank_speed(cfg: Config, device: torch.device, emulate_flops: float | None) -> float:
    """1 / the median time of one micro-batch's forward and backward through the whole model here."""
    t = cfg.train
    mb = max(1, t.global_batch // (cfg.parallel.batch_shards * t.grad_accum * cfg.parallel.micro_batches))
    torch.manual_seed(0)
    model = build_model(cfg.model).to(device)
    if emulate_flops is not None:
        emulate_device(model, emulate_flops)
    x = torch.randint(0, cfg.model.vocab_size, (mb, t.seq_len), device=device)
    # the first pays for allocations
    times = [synced_seconds(lambda: cross_entropy(model(x), x).backward(), device) for _ in range(REPS + 1)]
    return 1.0 / statistics.median(times[1:])


def resolve(cfg: Config, device: torch.device, emulate_flops: float | None = None) -> Config:
    """cfg with dp_split / pp_balance "speed" turned into dp_shares / pp_layout for this world."""
    p, r = cfg.parallel, cfg.runtime
    if p.dp_split != "speed" and p.pp_balance != "speed":
        return cfg
    world = dist.get_world_size() if dist.is_initialized() else 1
    speeds = r.device_speeds if r.device_speeds is not None and len(r.device_speeds) == world else None
    if speeds is None:
        speeds = _gathered(rank_speed(cfg, device, emulate_flops))
        speeds = [s / max(speeds) for s in speeds]
    memory = r.device_memory_gib if r.device_memory_gib is not None and len(r.device_memory_gib) == world else None
    if memory is not None:
        memory = [m * 2**30 for m in memory]
    else:
        memory = [device_budget(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", world))).per_rank] * world
    stage_memory = min_per_coord(memory, p.axis_sizes, p.rank_order, "pp")  # the smallest rank of each stage
    capacity = layer_capacity(cfg, stage_memory) if p.pp > 1 else None
    return with_speeds(cfg, speeds, capacity)


def _gathered(value: float) -> list[float]:
    if not dist.is_initialized():
        return [value]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
