"""Re-planning the layout when the world size changes (torchrun --nnodes MIN:MAX, or a smaller restart).

The rule is the simplest correct one: keep tp, pp, ep and cp (they fix how the
model and its sequences are cut, and a checkpoint loads into any cut anyway) and give the
remaining factor to dp. The global batch is kept: gradient accumulation takes
up the difference, so each rank's micro-batch stays as it was where it can.
Because the BatchSampler's batch for a step depends on the step alone, the
run continues on the same trajectory (up to the summation order of the
gradient reduction).
"""

from __future__ import annotations

import os
import uuid

from tessel.config import Config, ConfigError, check_layout


def replan(cfg: Config, world_size: int) -> Config:
    """A copy of cfg laid out for `world_size` ranks (cfg itself if it already fits)."""
    p, t = cfg.parallel, cfg.train
    if p.world_size == world_size:
        return cfg
    fixed = p.pp * p.tp * p.ep * p.cp
    if world_size % fixed:
        raise ConfigError("parallel", f"cannot re-plan for {world_size} ranks: pp*tp*ep*cp = {fixed} does not "
                                      "divide it")
    dp = world_size // fixed
    # sequences per micro-batch on one rank, before the change
    micro = t.global_batch // (p.dp * p.ep * t.grad_accum * p.micro_batches)
    split = dp * p.ep * p.micro_batches
    if t.global_batch % split:
        raise ConfigError("train.global_batch", f"({t.global_batch}) cannot be split over dp={dp} after "
                          f"re-planning for {world_size} ranks")
    per_rank = t.global_batch // split  # sequences per rank per micro-batch slot and step
    # the old micro-batch if it divides the new share, else the whole share at once
    accum = per_rank // micro if per_rank % micro == 0 and per_rank >= micro else 1
    new = cfg.model_copy(deep=True)
    new.parallel.dp = dp
    new.train.grad_accum = accum
    new.runtime.nproc_per_node = None
    check_layout(new, world_size=world_size)
    return new


def describe_change(old: Config, new: Config) -> str:
    return (f"[tessel elastic] world {old.parallel.world_size} -> {new.parallel.world_size}: "
            f"dp {old.parallel.dp} -> {new.parallel.dp}, grad_accum {old.train.grad_accum} -> "
            f"{new.train.grad_accum}, global batch {new.train.global_batch} kept")


def replan_for_world(cfg: Config, world_size: int, rank: int = 0) -> Config:
    new = replan(cfg, world_size)
    if new is not cfg and rank == 0:
        print(describe_change(cfg, new), flush=True)
    return new


def rendezvous_args(nnodes: str) -> list[str]:
    """torchrun arguments for an elastic node range. One machine by default; TESSEL_RDZV_ENDPOINT
    (host:port, the same on every node) and TESSEL_RDZV_ID join several machines."""
    from tessel.spawn import free_port  # deferred: loads torch; the launcher imports this module before torch
    endpoint = os.environ.get("TESSEL_RDZV_ENDPOINT") or f"localhost:{free_port()}"
    run_id = os.environ.get("TESSEL_RDZV_ID") or uuid.uuid4().hex[:12]
    # once MIN nodes are in, wait only briefly for more before starting
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            "--rdzv-conf=last_call_timeout=5"]
