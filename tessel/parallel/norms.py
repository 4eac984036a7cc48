"""The global gradient norm in any layout.

A parameter may be sharded over some mesh axes (tensor-parallel weights over
tp, experts over ep, ZeRO-2/3 gradients over dp) and replicated over the rest.
Its squared norm is summed over the axes that shard it and counted once over
the axes that replicate it. Pipeline stages hold disjoint parameters, so every
sum also runs over pp. Each parameter declares its sharding (tessel.sharding).
"""

from __future__ import annotations

import weakref
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.utils import clip_grads_with_norm_, get_total_norm

from tessel.axes import AXES
from tessel.mesh import Mesh
from tessel.sharding import is_replica, shard_axes


def _reduce_axes(axes: tuple[str, ...], mesh: Mesh) -> tuple[str, ...]:
    wanted = set(axes) | {"pp"}
    return tuple(a for a in AXES if a in wanted and mesh.size(a) > 1)


def global_grad_norm(params: Iterable[nn.Parameter], mesh: Mesh) -> torch.Tensor:
    """L2 norm of all gradients of the whole model, identical on every rank."""
    grads: dict[tuple[str, ...], list[torch.Tensor]] = {}
    keys = set()  # of every parameter, with a gradient this step or not: the same set every step
    for p in dict.fromkeys(params):
        if is_replica(p):
            continue
        key = _reduce_axes(shard_axes(p), mesh)
        keys.add(key)
        if p.grad is not None:
            grads.setdefault(key, []).append(p.grad.detach().float())
    # one multi-tensor norm kernel per group (torch's foreach path), not three kernels per parameter:
    # on a GPU the launches of a per-parameter loop cost more than the arithmetic
    sums = {key: get_total_norm(gs, 2.0).square() for key, gs in grads.items()}
    total = torch.zeros((), device=mesh.device)
    # iterate in a fixed order: all ranks of a group must issue the same collectives
    for key in sorted(_all_keys(frozenset(keys), mesh)):
        part = sums.get(key, torch.zeros((), device=mesh.device)).to(mesh.device)
        if key:
            mesh_group = _group_for(mesh, key)
            dist.all_reduce(part, group=mesh_group)
        total = total + part
    return total.sqrt()


# per mesh (weakly: a re-layout's mesh replaces it), this rank's keys -> the keys of every rank
_agreed: dict[int, tuple[weakref.ref, dict[frozenset, set[tuple[str, ...]]]]] = {}


def _all_keys(keys: frozenset, mesh: Mesh) -> set[tuple[str, ...]]:
    """Every rank must take part in every reduction, even with no such parameter locally (a pipeline stage
    without experts, say): the union of every rank's keys. all_gather_object goes through the host (on NCCL
    a copy that waits for the device), so it runs once per set of keys: a rank's keys are those of the
    parameters the optimizer steps, the same every step, on every rank at once."""
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return set(keys)
    ref, memo = _agreed.get(id(mesh), (None, None))
    if ref is None or ref() is not mesh:
        memo = {}
        _agreed[id(mesh)] = (weakref.ref(mesh), memo)
    if keys not in memo:
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, sorted(keys))
        memo[keys] = {tuple(k) for ks in gathered for k in ks}
    return memo[keys]


def _group_for(mesh: Mesh, axes: tuple[str, ...]):
    try:
        return mesh.group(*axes)
    except KeyError:
        mesh.build_groups([axes])  # collective: every rank reaches here with the same keys
        return mesh.group(*axes)


@torch.no_grad()
def clip_grad_norm_(params: Iterable[nn.Parameter], max_norm: float, mesh: Mesh) -> torch.Tensor:
    params = list(dict.fromkeys(params))
    norm = global_grad_norm(params, mesh)
    if max_norm > 0:  # every gradient times min(1, max_norm / (norm + 1e-6)), one foreach kernel per dtype
        clip_grads_with_norm_([p for p in params if p.grad is not None], max_norm, norm)
    return norm
