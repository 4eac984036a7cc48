"""What a parameter carries about how it is sharded, owned in one place.

A parameter (or a tensor that stands for one: a ZeRO segment) may be a shard
over some mesh axes (tensor-parallel weights over tp, experts over ep, ZeRO-2/3
segments over dp) and replicated over the rest. It carries one `Sharding`
record:
- `axes`: the mesh axes that shard it, in the order they were applied;
- `dims`: {axis: tensor dim} for the axes that split a plain tensor dim
  (layout-independent checkpoints rebuild the logical tensor from them);
- `logical_shape`: the whole, unpadded shape when the shard is padded (a
  vocabulary that tp does not divide);
- `replica`: a copy of a parameter that another pipeline stage holds and
  counts (a tied embedding on the last stage): updated like the original but
  left out of the gradient norm.
- `packed`: (axis, dim, blocks) for a dim that packs blocks side by side (a
  fused q|k|v projection; `blocks` their relative sizes, (1, 1, 1) for equal
  q, k, v, (H, KV, KV) for grouped-query heads) and splits each block over the
  axis: the shard is
  then not one piece of the dim, so the axis has no entry in `dims` (a reader
  that cuts plain pieces, a checkpoint, refuses it rather than misplace it).

- `placement`: a layout no (axis, dim) pair says (a block of a 2D / 2.5D / 3D tp grid, split on two
  dims inside the one tp axis); it builds its own DTensor for checkpoints (tessel.parallel.tensor_nd.grid).

Strategies mark parameters as they cut them (tensor, expert, then ZeRO, which
copies the marks of what it flattens onto its segments: so a mark must be set
before ZeRO runs, which tessel.apply's fixed order guarantees). Readers:
the global gradient norm (tessel.parallel.norms), the data-parallel and ZeRO
reducers (the axes a gradient still needs reducing over), checkpoints
(tessel.train.checkpoint.logical).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import torch

ATTR = "tessel_sharding"


class Placement(Protocol):
    """A shard whose layout no (axis, dim) pair says (a block of a 2D / 2.5D / 3D tp grid, split on two dims
    inside the one tp axis): it makes its own DTensor of the logical tensor for checkpoints, and cuts its
    block from a whole one (ZeRO's checkpoint hook reads whole tensors)."""
    shape: tuple[int, ...]  # the logical tensor's

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor: ...

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the logical tensor `full` (the local tensor of as_dtensor's DTensor)."""


@dataclass(frozen=True)
class Sharding:
    axes: tuple[str, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()  # (axis, dim) pairs: hashable, like the rest
    logical_shape: tuple[int, ...] | None = None
    replica: bool = False
    packed: tuple[tuple[str, int, tuple[int, ...]], ...] = ()  # (axis, dim, blocks): see mark_packed
    placement: Placement | None = None  # see set_placement


def set_placement(p: torch.Tensor, placement: Placement) -> None:
    """p's layout as a DTensor placement of its own (tessel.parallel.tensor_nd's grid blocks)."""
    _set(p, replace(sharding(p), placement=placement))


def placement(p: torch.Tensor) -> Placement | None:
    return sharding(p).placement


def sharding(p: torch.Tensor) -> Sharding:
    """The record p carries (replicated and whole when it carries none)."""
    return p.__dict__.get(ATTR, Sharding())


def _set(p: torch.Tensor, record: Sharding) -> None:
    p.__dict__[ATTR] = record


def mark_sharded(p: torch.Tensor, *axes: str, dim: int | None = None) -> None:
    """Declare p a shard over `axes` (added to those it has); `dim` is the tensor dim they split
    (None: not a plain split, e.g. a flat ZeRO segment)."""
    s = sharding(p)
    dims = dict(s.dims)
    if dim is not None:
        dims.update({a: dim for a in axes})
    _set(p, replace(s, axes=tuple(dict.fromkeys((*s.axes, *axes))), dims=tuple(dims.items())))


def mark_packed(p: torch.Tensor, axis: str, dim: int, blocks: int | tuple[int, ...]) -> None:
    """Declare p a shard over `axis` of a dim made of blocks side by side, each split over the axis: rank r
    holds the r-th chunk of every block, side by side (a fused q|k|v projection split by heads). `blocks`:
    their relative sizes (an int n: n equal blocks), the same in the shard as in the whole tensor."""
    s = sharding(p)
    blocks = (1,) * blocks if isinstance(blocks, int) else tuple(blocks)
    _set(p, replace(s, axes=tuple(dict.fromkeys((*s.axes, axis))), packed=(*s.packed, (axis, dim, blocks))))


def packed_dims(p: torch.Tensor) -> dict[str, tuple[int, tuple[int, ...]]]:
    """{axis: (dim, blocks)} for the axes that split p's dim block by block (mark_packed)."""
    return {axis: (dim, blocks) for axis, dim, blocks in sharding(p).packed}


def block_sizes(blocks: tuple[int, ...], total: int) -> list[int]:
    """The sizes of packed blocks of relative sizes `blocks` along a dim of `total` entries (a shard's or
    the whole tensor's)."""
    unit, rest = divmod(total, sum(blocks))
    if rest:
        raise ValueError(f"{total} entries do not pack blocks of relative sizes {blocks}")
    return [unit * b for b in blocks]


def mark_replica(p: torch.Tensor) -> None:
    """p is a copy of a parameter that another pipeline stage holds and counts (a tied
    embedding on the last stage): it is updated like the original but left out of the norm."""
    _set(p, replace(sharding(p), replica=True))


def set_logical_shape(p: torch.Tensor, shape) -> None:
    """p's whole shape without padding (a padded tp shard of the vocabulary)."""
    _set(p, replace(sharding(p), logical_shape=tuple(shape)))


def shard_axes(p: torch.Tensor) -> tuple[str, ...]:
    return sharding(p).axes


def shard_dims(p: torch.Tensor) -> dict[str, int]:
    return dict(sharding(p).dims)


def logical_shape(p: torch.Tensor) -> tuple[int, ...] | None:
    return sharding(p).logical_shape


def is_replica(p: torch.Tensor) -> bool:
    return sharding(p).replica
