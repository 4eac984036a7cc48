"""Checkpoints of ZeRO state as LOGICAL whole tensors (tessel.train.checkpoint.logical's hook).

A ZeRO run keeps its parameters (stage 3) and its AdamW state (stages 1-3) in
flat buffers cut into N shards (tessel.parallel.zero.flat). A checkpoint must
not depend on N or on the stage, so it holds what a plain run would:
`model/<name>` for every parameter and `optim/<name>/{step,exp_avg,exp_avg_sq}`
for AdamW, under the full model's parameter names.

- save: every flat group's parameter shard and optimizer-state shards are
  all-gathered over the group's ranks, then cut into per-parameter views. A
  parameter AdamW never stepped (no rank ever used it) has no optim/ entries,
  as under a plain AdamW; each has its own step.
- load: every rank reads the whole logical tensors (DCP, without coordination,
  so any saved layout reshards into this one), lays them out flat like its own
  group and copies its slice into the shard (and, stages 1 and 2, the whole
  flat buffer into the parameters).

Whole-tensor gathering means each rank briefly holds one group's whole state
on save and the whole model's state on load: fine at tessel's scale, but a
rank-local DTensor/chunked layout would be needed for models that do not fit
one rank. A parameter that is itself a tp shard is saved as that shard, whole
over the ZeRO axes; tessel.train.checkpoint.logical makes it a DTensor over tp and, on
load, cuts this rank's piece from the logical tensor (`localize`); an expert
sharded over ep likewise, and a block of a 2D / 2.5D / 3D tp grid by its own
placement (tessel.parallel.tensor_nd.grid.GridPlacement). Under a pipeline the engine wraps the rank's list of
chunks, and names a parameter as the full model does (ZeroDataParallel.model_name),
so a stage holds a subset of the keys. A tied weight's optimizer state is saved
under each of its names: a pipeline's last stage holds the head as a copy of
its own and reads that copy's state by the head's name.
"""

from __future__ import annotations

import bisect
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from tessel.parallel.adamw import step_count
from tessel.parallel.zero.collectives import all_gather_shards
from tessel.parallel.zero.engine import ZeroDataParallel
from tessel.parallel.zero.flat import FlatGroup

MODEL, OPTIM = "model/", "optim/"
MOMENTS = ("exp_avg", "exp_avg_sq")


def param_names(engine: ZeroDataParallel) -> dict[int, list[str]]:
    """id(param) -> every name it has in the wrapped module (tied weights have two)."""
    names: dict[int, list[str]] = {}
    for n, p in engine.module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(engine.model_name(n))
    return names


def segment_offsets(optimizer: torch.optim.Optimizer, groups: list[FlatGroup]) -> list[tuple[nn.Parameter, int, int]]:
    """(segment, group index, offset inside the group's shard) for every optimizer segment."""
    out = []
    for pg in optimizer.param_groups:
        for seg in pg["params"]:
            for gi, g in enumerate(groups):
                if seg.untyped_storage().data_ptr() == g.shard.untyped_storage().data_ptr():
                    out.append((seg, gi, seg.storage_offset() - g.shard.storage_offset()))
                    break
            else:
                raise RuntimeError("a ZeRO optimizer segment lies in no flat group")
    return out


def _gather(g: FlatGroup, shard: torch.Tensor) -> torch.Tensor:
    """(numel/N,) owned piece -> (numel,) whole flat tensor, same on every rank of the group."""
    full = torch.empty(shard.numel() * g.comm.world, dtype=shard.dtype, device=shard.device)
    all_gather_shards(full, shard.contiguous(), g.comm.group, async_op=False)
    return full


def param_at(g: FlatGroup, position: int) -> nn.Parameter:
    """The parameter of g whose elements include flat `position`."""
    return g.params[bisect.bisect_right(g.offsets, position) - 1]


def _steps(g: FlatGroup, gi: int, segs, optimizer: torch.optim.Optimizer) -> list[float]:
    """AdamW's step of each parameter of g (-1: never stepped), the same on every rank of the group:
    a rank holds the step of the parameters its shard cuts, maybe none."""
    steps = torch.full((len(g.params),), -1.0, dtype=torch.float64, device=g.shard.device)  # NCCL: on device
    index = {id(p): i for i, p in enumerate(g.params)}
    for seg, sgi, off in segs:
        if sgi == gi and "step" in optimizer.state.get(seg, {}):
            steps[index[id(param_at(g, g.lo + off))]] = float(optimizer.state[seg]["step"])
    if g.comm.group is not None:
        dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=g.comm.group)
    return steps.tolist()


@torch.no_grad()
def checkpoint_tensors(engine: ZeroDataParallel, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Logical model and AdamW tensors of every parameter in the flat groups (collective)."""
    groups = engine.groups
    names = param_names(engine)
    segs = segment_offsets(optimizer, groups)
    out: dict[str, torch.Tensor] = {}
    for gi, g in enumerate(groups):
        steps = _steps(g, gi, segs, optimizer)
        flats = {"param": _gather(g, g.shard)}
        if max(steps) >= 0:
            for key in MOMENTS:
                local = torch.zeros_like(g.shard)
                for seg, sgi, off in segs:
                    if sgi == gi and key in optimizer.state.get(seg, {}):
                        local[off: off + seg.numel()].copy_(optimizer.state[seg][key])
                flats[key] = _gather(g, local)
        for p, start, step in zip(g.params, g.offsets, steps):
            ns = names[id(p)]
            for n in ns:
                out[MODEL + n] = flats["param"][start: start + p.numel()].view(p.shape).clone()
            for n in ns if step >= 0 else ():  # every name of a tied weight (a pipeline's last stage reads
                out[f"{OPTIM}{n}/step"] = torch.tensor(step, dtype=torch.float32)  # the head's by its own)
                for key in MOMENTS:
                    out[f"{OPTIM}{n}/{key}"] = flats[key][start: start + p.numel()].view(p.shape).clone()
    return out


def model_names(engine: ZeroDataParallel) -> set[str]:
    """The model/ keys the ZeRO hook loads itself (tessel.train.checkpoint.logical leaves them alone)."""
    names = param_names(engine)
    return {n for g in engine.groups for p in g.params for n in names[id(p)]}


@torch.no_grad()
def load_checkpoint_tensors(engine: ZeroDataParallel, optimizer: torch.optim.Optimizer, reader, metadata,
                            localize=None) -> None:
    """Read logical tensors (any saved layout) and copy this rank's slices into the flat shards.

    localize(whole, param) cuts the piece a tp-sharded parameter holds on this rank
    (tessel.train.checkpoint.logical.LogicalView.local_slice); None: parameters are whole over tp."""
    groups = engine.groups
    names = param_names(engine)
    saved = metadata.state_dict_metadata
    targets: dict[str, torch.Tensor] = {}
    for g in groups:
        for p in g.params:
            n = names[id(p)][0]
            if MODEL + n not in saved:
                raise KeyError(f"the checkpoint has no '{n}' (its model differs from this one)")
            md = saved[MODEL + n]  # the logical size: of a tp shard, the whole tensor
            targets[MODEL + n] = torch.zeros(md.size, dtype=g.shard.dtype, device=g.shard.device)  # fp32 master
            for key in ("step",) + MOMENTS:
                if f"{OPTIM}{n}/{key}" in saved:
                    md = saved[f"{OPTIM}{n}/{key}"]
                    targets[f"{OPTIM}{n}/{key}"] = torch.zeros(md.size, dtype=md.properties.dtype,
                                                              device="cpu" if key == "step" else g.shard.device)
    # every rank reads what it needs on its own: whole tensors, no collective
    with warnings.catch_warnings():  # DCP warns that no_dist means "a single process": intended here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(targets, storage_reader=reader, no_dist=True)
    has_optim = any(k.startswith(OPTIM) for k in targets)

    def local(whole: torch.Tensor, p: nn.Parameter) -> torch.Tensor:
        return whole if localize is None or whole.shape == p.shape else localize(whole, p)

    flats = []
    for g in groups:
        flat = {k: torch.zeros(g.shard.numel() * g.comm.world, dtype=g.shard.dtype, device=g.shard.device)
                for k in ("param",) + (MOMENTS if has_optim else ())}
        for p, start in zip(g.params, g.offsets):
            n = names[id(p)][0]
            flat["param"][start: start + p.numel()].copy_(local(targets[MODEL + n], p).reshape(-1))
            for key in MOMENTS if has_optim else ():
                if f"{OPTIM}{n}/{key}" in targets:  # a parameter a plain AdamW never stepped has none
                    flat[key][start: start + p.numel()].copy_(local(targets[f"{OPTIM}{n}/{key}"], p).reshape(-1))
        g.shard.copy_(flat["param"][g.lo: g.hi])  # the master; stage 3 gathers the parameters from it
        if g.gathered:  # stages 1, 2 (stage 3 inside gathered()): every parameter is a view of it
            g.full.copy_(flat["param"])
        flats.append(flat)
    if not has_optim:
        return
    for seg, gi, off in segment_offsets(optimizer, groups):
        lo = groups[gi].lo + off
        step = targets.get(f"{OPTIM}{names[id(param_at(groups[gi], lo))][0]}/step")
        if step is None:  # a parameter AdamW never stepped: no state, as in the saved run
            optimizer.state.pop(seg, None)
            continue
        optimizer.state[seg] = {"step": step_count(optimizer, seg, step), **{k: flats[gi][k][lo: lo + seg.numel()].clone()
                                                          for k in MOMENTS}}
