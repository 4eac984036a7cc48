"""The flat, sharded layout under ZeRO: flat groups of parameters, cut into equal shards.

A flat group is one contiguous buffer holding several parameters, zero-padded
to a multiple of N (the size of the process group that shards it) and cut into
N equal shards; rank r of that group owns elements [r*S, (r+1)*S), S = size/N.
The padding stays zero through training: its gradient is zero and AdamW moves
a zero weight with a zero gradient nowhere.

Two layouts: gradient buckets (stages 1, 2: sized so that reductions overlap
backward, as in tessel.parallel.data) and units (stage 3: what is gathered as
one, by default each block of the model, plus the rest as the root unit; see
find_units and size_based_units).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch
import torch.nn as nn

from tessel.parallel.data.data_parallel import Bucket, build_buckets
from tessel.parallel.data.unused import NO_GRADIENT


@dataclass(frozen=True)
class Comm:
    """The process group that shards a flat group: over `axes` of the mesh."""
    axes: tuple[str, ...]
    group: object  # None when the axes have size 1
    world: int
    rank: int  # rank inside `group`: the order of shards in its collectives


@dataclass(frozen=True)
class Precision:
    """Mixed-precision storage: the module computes with parameters in param_dtype and
    gradients are reduced in grad_dtype; the optimizer's masters stay fp32."""
    param_dtype: torch.dtype = torch.float32
    grad_dtype: torch.dtype = torch.float32


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
    gathered: bool = True                   # `full` holds the whole parameters now (stages 1, 2: always)
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
        return self.full[self.offsets[i]: self.offsets[i] + p.numel()].view(p.shape)

    def grad_view(self, i: int) -> torch.Tensor:
        """Parameter i's view of the flat gradient buffer, allocated as "no gradient" if there is none."""
        if self.buffer is None:
            self.buffer = torch.full(self.full.shape, NO_GRADIENT, dtype=self.grad_dtype, device=self.full.device)
        return self.view_of(i)

    def shard_source(self) -> torch.Tensor:
        """What this rank contributes to the gather of `full`: the master shard, cast if needed."""
        return self.shard if self.shard.dtype == self.full.dtype else self.shard.to(self.full.dtype)

    def complete(self) -> bool:
        """Every parameter's gradient has arrived in this backward."""
        return len(self.ready) == len(self.params)


def trainable(module: nn.Module) -> list[nn.Parameter]:
    """The parameters that train, each once (a tied weight is one parameter), in module order."""
    return list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))


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


@dataclass(frozen=True)
class FlatSpec:
    """What a layout is built from: the module, its trainable parameters, and the choices."""
    module: nn.Module
    params: list[nn.Parameter]               # trainable, in module order
    by_comm: dict[Comm, list[nn.Parameter]]  # the process group that shards each
    bucket_bytes: int                        # stages 1, 2: gradient bucket size
    units: Sequence[nn.Module] | None        # stage 3: gathered as one; None: find_units(module)
    precision: Precision


# ---- stages 1, 2: gradient buckets ----------------------------------------------------
def bucket_layout(spec: FlatSpec) -> list[FlatGroup]:
    """Gradient buckets (tessel.parallel.data.data_parallel) with a parameter buffer beside
    each, for every process group, sorted in gradient order."""
    # reverse order approximates the order in which gradients become ready
    order = {id(p): i for i, p in enumerate(reversed(spec.params))}
    groups = [g for comm, ps in spec.by_comm.items()
              for g in _bucket_groups(ps, spec.bucket_bytes, comm, order, spec.precision)]
    return sorted(groups, key=lambda g: g.first)


def _bucket_groups(params: Sequence[nn.Parameter], bucket_bytes: int, comm: Comm, order: dict[int, int],
                   precision: Precision) -> list[FlatGroup]:
    groups = []
    for b in build_buckets(list(reversed(params)), bucket_bytes, align=comm.world):
        # the gradient buffer is the stage's to allocate (tessel.parallel.zero.gradients)
        g = FlatGroup(b.params, None, b.offsets, comm=comm, full=torch.zeros_like(b.buffer),
                      first=order[id(b.params[0])], grad_dtype=precision.grad_dtype)
        _flatten_into(g, precision.param_dtype, separate_shard=False)
        groups.append(g)
    return groups


# ---- stage 3: units -------------------------------------------------------------------
class UnitLayout(NamedTuple):
    modules: list[nn.Module]         # the units that hold parameters, forward order
    units: list[list[FlatGroup]]     # their flat groups (one per process group), same order
    root: list[FlatGroup]            # what no unit claims (embedding, head, final norm)

    def gradient_order(self) -> list[FlatGroup]:
        # gradients of the last unit are ready first; the root (embedding, head) completes last
        return [g for unit in reversed(self.units) for g in unit] + self.root


def unit_layout(spec: FlatSpec) -> UnitLayout:
    """One flat group per unit and process group; a parameter belongs to the first unit holding it."""
    units = find_units(spec.module) if spec.units is None else spec.units
    comm_of = {id(p): comm for comm, ps in spec.by_comm.items() for p in ps}
    claimed: set[int] = set()
    layout = UnitLayout([], [], [])
    for u in units:
        ps = [p for p in dict.fromkeys(u.parameters()) if id(p) in comm_of and id(p) not in claimed]
        claimed.update(id(p) for p in ps)
        if ps:
            layout.units.append(_unit_groups(ps, comm_of, len(layout.units), spec.precision))
            layout.modules.append(u)
    rest = [p for ps in spec.by_comm.values() for p in ps if id(p) not in claimed]
    layout.root.extend(_unit_groups(rest, comm_of, -1, spec.precision))
    return layout


def _unit_groups(ps: list[nn.Parameter], comm_of: dict[int, Comm], index: int,
                 precision: Precision) -> list[FlatGroup]:
    per: dict[Comm, list[nn.Parameter]] = {}
    for p in ps:
        per.setdefault(comm_of[id(p)], []).append(p)
    return [_unit_group(group_ps, comm, index, precision) for comm, group_ps in per.items()]


def _unit_group(params: Sequence[nn.Parameter], comm: Comm, index: int, precision: Precision) -> FlatGroup:
    """One unit's parameters; only the owned (master) shard stays allocated."""
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) != 1:
        raise ValueError(f"a ZeRO-3 unit needs one dtype and device, got {kinds}")
    numels = [p.numel() for p in params]
    offsets = [sum(numels[:i]) for i in range(len(params))]
    padded = -(-sum(numels) // comm.world) * comm.world
    full = torch.zeros(padded, dtype=params[0].dtype, device=params[0].device)
    g = FlatGroup(list(params), None, offsets, comm=comm, full=full, index=index, grad_dtype=precision.grad_dtype)
    _flatten_into(g, precision.param_dtype, separate_shard=True)
    return g


CONTAINERS = (nn.ModuleList, nn.Sequential)


def find_units(module: nn.Module) -> list[nn.Module]:
    """Default stage-3 units: each child holding parameters of each nn.ModuleList or nn.Sequential,
    outermost containers first (the module itself counts), in registration order.

    The blocks of a model are kept in such containers: the decoder layers of a GPT, Llama or
    GPT-2 (a ModuleList), the BasicBlocks of a ResNet's stages (Sequentials), the layers of a
    plain Sequential. A container inside a unit (a block's downsample) belongs to that unit.
    A module with no container gets none: pass `units` (size_based_units picks them by size)."""
    units, inside = [], set()
    for m in module.modules():
        if id(m) in inside or not isinstance(m, CONTAINERS):
            continue
        for child in m.children():
            inside.update(id(x) for x in child.modules())
            if any(True for _ in child.parameters()):
                units.append(child)
    return units


def size_based_units(module: nn.Module, min_params: int) -> list[nn.Module]:
    """Stage-3 units chosen by size, as FSDP's size_based_auto_wrap_policy: bottom up, a submodule
    becomes a unit once the parameters it holds outside smaller units reach min_params. What
    stays unclaimed (the module's own parameters and small leftovers) forms the root unit."""
    units: list[nn.Module] = []

    def claim(m: nn.Module) -> int:
        """The parameters of m not yet in a unit (m's subtree claims first)."""
        free = sum(claim(child) for child in m.children()) + sum(p.numel() for p in m.parameters(recurse=False))
        if m is not module and free >= min_params:
            units.append(m)
            return 0
        return free

    claim(module)
    return units
