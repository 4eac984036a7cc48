"""The flat, sharded layout under tessel.parallel.zero.zero_parallel: buffers, shards, optimizer segments.

A flat group is one contiguous buffer holding several parameters, zero-padded
to a multiple of N (the size of the process group that shards it) and cut into
N equal shards; rank r of that group owns elements [r*S, (r+1)*S), S = size/N.
The padding stays zero through training: its gradient is zero and AdamW moves
a zero weight with a zero gradient nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.parallel.data.data_parallel import Bucket, build_buckets
from tessel.sharding import is_replica, mark_replica, mark_sharded, shard_axes


@dataclass(frozen=True)
class Comm:
    """The process group that shards a flat group: over `axes` of the mesh."""
    axes: tuple[str, ...]
    group: object  # None when the axes have size 1
    world: int
    rank: int  # rank inside `group`: the order of shards in its collectives


# ---- collectives (gloo and NCCL both implement the single-tensor forms) ------------
def all_gather(out: torch.Tensor, inp: torch.Tensor, group, async_op: bool = True):
    if group is None:
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return None
    return dist.all_gather_single(out, inp, group=group, async_op=async_op)


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group):
    if group is None:
        out.copy_(inp)
        return None
    return dist.reduce_scatter_single(out, inp, group=group, async_op=True)


@dataclass
class FlatGroup(Bucket):
    """A flat parameter buffer (`full`) and its gradient buffer (Bucket.buffer), in N shards.

    Bucket.buffer is the full-size gradient (None while it is not needed, stages 2, 3);
    `grad_shard` is the reduced gradient of the owned shard. Under mixed precision
    `full` (what the module computes with) is in the low precision and `shard`, the
    fp32 master, is a tensor of its own; `grad_dtype` is the reduction's dtype."""
    comm: Comm | None = None
    full: torch.Tensor | None = None        # (numel,) stage 3: storage freed when not gathered
    shard: torch.Tensor | None = None       # (numel/N,) fp32 owned params; a view of `full` if same dtype, stages 1, 2
    grad_shard: torch.Tensor | None = None  # (numel/N,) fp32
    grad_dtype: torch.dtype = torch.float32
    out: torch.Tensor | None = None         # reduce-scatter output while in flight
    gather_work: object = None
    gathered: bool = True
    index: int = -1                         # stage 3: the unit's position in forward order; -1: root
    first: int = 0                          # position of its first parameter in gradient order

    @property
    def lo(self) -> int:
        return self.comm.rank * (self.full.numel() // self.comm.world)

    @property
    def hi(self) -> int:
        return (self.comm.rank + 1) * (self.full.numel() // self.comm.world)

    def param_view(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.full[self.offsets[i]: self.offsets[i] + p.numel()].view_as(p)

    def shard_source(self) -> torch.Tensor:
        """What this rank contributes to the gather of `full`: the master shard, cast if needed."""
        return self.shard if self.shard.dtype == self.full.dtype else self.shard.to(self.full.dtype)


def _flatten_into(g: FlatGroup, param_dtype: torch.dtype, separate_shard: bool) -> None:
    """Lay the parameters out flat: the fp32 master shard, and g.full in param_dtype with
    every parameter a view of it. The shard is a view of g.full unless separate_shard
    (stage 3) or the dtypes differ."""
    master = g.full  # fp32, zero padding
    with torch.no_grad():
        for i, p in enumerate(g.params):
            view = g.param_view(i)
            view.copy_(p.detach())
            p.data = view
        g.shard = master[g.lo: g.hi]
        if param_dtype != master.dtype:
            g.full = master.to(param_dtype)  # the copy the module computes with
            for i, p in enumerate(g.params):
                p.data = g.param_view(i)
        if param_dtype != master.dtype or separate_shard:
            g.shard = g.shard.clone()  # the only fp32 copy; the whole master buffer is freed


def bucket_groups(params: Sequence[nn.Parameter], bucket_bytes: int, comm: Comm, stage: int,
                  order: dict[int, int], param_dtype: torch.dtype = torch.float32,
                  grad_dtype: torch.dtype = torch.float32) -> list[FlatGroup]:
    """Stages 1, 2: gradient buckets (tessel.parallel.data.data_parallel) with a parameter buffer beside each."""
    # reverse order approximates the order in which gradients become ready
    groups = []
    for b in build_buckets(list(reversed(params)), bucket_bytes, align=comm.world):
        g = FlatGroup(b.params, b.buffer, b.offsets, comm=comm, full=torch.zeros_like(b.buffer),
                      first=order[id(b.params[0])], grad_dtype=grad_dtype)
        _flatten_into(g, param_dtype, separate_shard=False)
        if stage == 1:
            g.buffer = b.buffer.to(grad_dtype)  # zeros
            # the all-reduced gradient, seen in place when it is fp32; else a copy of it
            g.grad_shard = g.buffer[g.lo: g.hi] if grad_dtype == g.shard.dtype else torch.zeros_like(g.shard)
        else:
            g.buffer = None  # allocated by the first gradient, freed once reduce-scattered
            g.grad_shard = torch.zeros_like(g.shard)
        groups.append(g)
    return groups


def unit_group(params: Sequence[nn.Parameter], comm: Comm, index: int, param_dtype: torch.dtype = torch.float32,
               grad_dtype: torch.dtype = torch.float32) -> FlatGroup:
    """Stage 3: one unit's parameters; only the owned (master) shard stays allocated."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(f"a ZeRO-3 unit needs one dtype and device, got {kinds}")
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(params))]
    padded = -(-sum(numels) // comm.world) * comm.world
    full = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    g = FlatGroup(list(params), None, offsets, comm=comm, full=full, index=index, grad_dtype=grad_dtype)
    _flatten_into(g, param_dtype, separate_shard=True)
    g.grad_shard = torch.zeros_like(g.shard)
    return g


def find_units(module: nn.Module) -> list[nn.Module]:
    """Default stage-3 units: each child of each nn.ModuleList, outermost lists first."""
    units, inside = [], set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, nn.ModuleList):
            continue
        for child in m:
            units.append(child)
            inside.update(id(x) for x in child.modules())
    return units


def segments(groups: Sequence[FlatGroup], decay: Callable[[nn.Parameter], bool]
             ) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """The optimizer's parameters: owned pieces of each flat group, split by decay and sharding.

    Each segment aliases the owned parameter shard, and its gradient the gradient
    shard, so the optimizer updates the flat buffers in place. A segment is marked
    sharded over its group's axes and over those its parameters were already
    sharded on (tp, ep), so the global gradient norm adds the pieces up; a piece of
    a replica (tessel.sharding.mark_replica) is a replica too."""
    out: tuple[list, list] = ([], [])
    for g in groups:
        pieces = []  # (start, end, key) in flat coordinates, clipped to the owned shard
        for p, off in zip(g.params, g.offsets):
            a, b = max(g.lo, off), min(g.hi, off + p.numel())
            if a >= b:
                continue
            key = (bool(decay(p)), shard_axes(p), is_replica(p))
            if pieces and pieces[-1][2] == key and pieces[-1][1] == a:
                pieces[-1] = (pieces[-1][0], b, key)
            else:
                pieces.append((a, b, key))
        for a, b, (dec, axes, replica) in pieces:
            seg = nn.Parameter(g.shard[a - g.lo: b - g.lo], requires_grad=False)
            seg.grad = g.grad_shard[a - g.lo: b - g.lo]
            mark_sharded(seg, *g.comm.axes, *axes)
            if replica:  # a copy another pipeline stage counts (the last stage's tied head)
                mark_replica(seg)
            out[0 if dec else 1].append(seg)
    return out

