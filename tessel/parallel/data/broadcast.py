"""One starting point on every rank, and buffers that stay the first rank's: the broadcasts of DP and ZeRO.

At wrap time every parameter (frozen ones too) and buffer goes from the first rank
of the axes that replicate it to the others, as DDP's and FSDP's module-state sync
does, so ranks built from different seeds train one model.

During training, buffers that forward updates (BatchNorm's running statistics)
drift apart: each rank normalises its own batch. `BufferBroadcast` is DDP's
broadcast_buffers (Li et al. 2020, "PyTorch Distributed"): before
each forward that will be followed by a synchronised backward, the first rank's
buffers overwrite the others'. It takes the module's persistent buffers (those
in its state_dict), where DDP takes all: a non-persistent buffer is a value the
module derives and never saves (rotary tables, causal masks), the same on every
rank, so sending it every step would cost traffic for nothing (the reference GPT
and the Hugging Face Llama and GPT-2 have only such buffers).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.sharding import shard_axes


def group_of(mesh: Mesh, axes: tuple[str, ...]):
    """mesh.group(*axes), creating it if this combination is new (collective: the
    layout is the same on every rank, so all ranks reach here with the same axes)."""
    if mesh.size(*axes) == 1:
        return None
    try:
        return mesh.group(*axes)
    except KeyError:
        mesh.build_groups([axes])
        return mesh.group(*axes)


def replicating_axes(t: torch.Tensor, axes: Sequence[str]) -> tuple[str, ...]:
    """The axes among `axes` over which t is replicated (all of them unless t is sharded over one)."""
    return tuple(a for a in axes if a not in shard_axes(t))


def broadcast_tensors(tensors: list[torch.Tensor], src: int, group=None) -> None:
    """Broadcast tensors from global rank `src`, flattened per dtype to send few messages."""
    by_dtype: dict[tuple, list[torch.Tensor]] = {}
    for t in dict.fromkeys(tensors):
        by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for group_tensors in by_dtype.values():
        flat = torch.cat([t.detach().reshape(-1) for t in group_tensors])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        with torch.no_grad():
            for t in group_tensors:
                t.copy_(flat[offset: offset + t.numel()].view_as(t))
                offset += t.numel()


def broadcast_by_axes(mesh: Mesh, axes: Sequence[str], tensors: Sequence[torch.Tensor]) -> None:
    """Each tensor from the first rank of the axes (among `axes`) that replicate it: shards stay distinct."""
    by_axes: dict[tuple[str, ...], list[torch.Tensor]] = {}
    for t in tensors:
        by_axes.setdefault(replicating_axes(t, axes), []).append(t)
    for rep, ts in by_axes.items():
        group = group_of(mesh, rep)
        if group is not None:
            broadcast_tensors(ts, src=mesh.group_ranks(rep)[0], group=group)


def persistent_buffers(module: nn.Module) -> list[torch.Tensor]:
    """The buffers a state_dict holds (BatchNorm's statistics), each once."""
    saved = {id(t) for t in module.state_dict(keep_vars=True).values()}
    return [b for b in dict.fromkeys(module.buffers()) if id(b) in saved]


class BufferBroadcast:
    """broadcast_buffers: the first rank's persistent buffers to every rank of `axes`, on call."""

    def __init__(self, module: nn.Module, mesh: Mesh, axes: Sequence[str]):
        self.mesh, self.axes = mesh, tuple(axes)
        self.buffers = persistent_buffers(module)

    def __call__(self) -> None:
        if self.buffers:
            broadcast_by_axes(self.mesh, self.axes, self.buffers)
