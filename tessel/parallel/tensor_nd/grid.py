"""The tensor-parallel group viewed as a grid: q x q (2D), d x q x q (2.5D), c x c x c (3D).

Rank order: the tp group's t-th member (t = its index in mesh.group_ranks(("tp",)))
sits at the grid coordinates of t unravelled row-major over the grid's shape,
so the last grid dimension varies fastest. For 2D (shape (q, q)), t = i*q + j:
row i, column j; for 2.5D (shape (d, q, q)), t = k*q*q + i*q + j (depth k
outermost). Along each grid dimension a rank has one process group, the ranks
that share every other coordinate, ordered by their coordinate on that
dimension (a group's local rank is this rank's coordinate).

Groups are created with torch.distributed.new_group by every rank for every tp
group of the mesh in the same order (new_group is collective), and handed out
through the Grid object: nothing is kept in module globals.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessel.mesh import Mesh


@dataclass(frozen=True)
class Grid:
    """This rank's place on the grid and its process group along each grid dimension."""
    shape: tuple[int, ...]
    coords: tuple[int, ...]
    groups: tuple[object, ...]  # groups[a]: ranks differing only in coordinate a (None if that size is 1)
    ranks: tuple[tuple[int, ...], ...]  # ranks[a][c]: the global rank at coordinate c along a, others as mine
    members: tuple[int, ...] = ()  # this tp group's global ranks, row-major over the grid
    _meshes: dict = field(default_factory=dict, compare=False, repr=False)  # DeviceMeshes by axis order

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def device_mesh(self, order: tuple[int, ...]):
        """A torch DeviceMesh over this tp group with the grid's axes in `order` (nested shards of one tensor
        dim follow the mesh's dims): made from the grid's own groups, no new process group, no collective."""
        if order not in self._meshes:
            ranks = torch.tensor(self.members).reshape(self.shape).permute(order)
            self._meshes[order] = DeviceMesh.from_group([self.groups[a] for a in order], "cpu", mesh=ranks,
                                                         mesh_dim_names=tuple(f"grid{a}" for a in order))
        return self._meshes[order]

    def src(self, axis: int, coord: int) -> int:
        """The global rank at `coord` along grid dimension `axis`, sharing my other coordinates."""
        return self.ranks[axis][coord]


def grid_members(tp_ranks: list[int], shape: tuple[int, ...]) -> dict[int, tuple[int, ...]]:
    """{global rank: grid coordinates} for one tp group (row-major, see the module docstring)."""
    if len(tp_ranks) != math.prod(shape):
        raise ValueError(f"a tp group of {len(tp_ranks)} ranks is not a {'x'.join(map(str, shape))} grid")
    return dict(zip(tp_ranks, itertools.product(*(range(n) for n in shape)), strict=True))


def _line(members: dict[int, tuple[int, ...]], fixed: tuple[int, ...], axis: int) -> list[int]:
    """Ranks whose coordinates equal `fixed` except along `axis`, in that axis's order."""
    by_coords = {c: r for r, c in members.items()}
    return [by_coords[fixed[:axis] + (k,) + fixed[axis + 1:]] for k in range(len({c[axis] for c in by_coords}))]


def build_grid(mesh: Mesh, shape: tuple[int, ...]) -> Grid:
    """This rank's Grid over its tp group. Collective: every rank of the world calls it."""
    mine_coords, mine_members, groups, ranks = None, (), [None] * len(shape), [()] * len(shape)
    for tp_ranks in mesh.all_groups(("tp",)):
        members = grid_members(tp_ranks, shape)
        for axis in range(len(shape)):
            seen = set()
            for coords in members.values():
                line = tuple(_line(members, coords, axis))
                if line in seen:
                    continue
                seen.add(line)
                group = dist.new_group(list(line)) if shape[axis] > 1 else None  # every rank takes part
                if mesh.rank in line:
                    groups[axis], ranks[axis] = group, line
        if mesh.rank in members:
            mine_coords, mine_members = members[mesh.rank], tuple(tp_ranks)
    return Grid(tuple(shape), mine_coords, tuple(groups), tuple(ranks), mine_members)


def describe_grid(mesh: Mesh, shape: tuple[int, ...], coordinates: str) -> str:
    """Each tp group's grid as text: 'coords -> rank' (printed with the mesh)."""
    lines = [f"tp grid {'x'.join(map(str, shape))}, coordinates {coordinates}, row-major:"]
    for tp_ranks in mesh.all_groups(("tp",)):
        members = grid_members(tp_ranks, shape)
        lines.append("  " + " ".join(f"{c}->{r}" for r, c in members.items()))
    return "\n".join(lines)


def to_compute_dtype(t: torch.Tensor) -> torch.Tensor:
    """`t` in autocast's dtype where autocast is on (bf16 training), else unchanged. A grid linear casts its
    panels before it communicates them, as autocast would cast them at the matmul: the collectives move
    bf16, and SUMMA's custom matmul (which autocast does not see) multiplies in it."""
    kind = t.device.type
    if t.is_floating_point() and torch.is_autocast_enabled(kind):
        return t.to(torch.get_autocast_dtype(kind))
    return t


@dataclass(frozen=True)
class GridPlacement:
    """A grid block's place in its logical tensor, as a DTensor (tessel.sharding.Placement): the grid's axes
    in `order` become the DeviceMesh's dims, `dims[n]` the tensor dim the n-th of them splits (None:
    replicated along it, 2.5D's depth). Checkpoints save the logical tensor and any layout reads it back."""
    grid: Grid
    order: tuple[int, ...]
    dims: tuple[int | None, ...]
    shape: tuple[int, ...]

    def as_dtensor(self, local: torch.Tensor) -> torch.Tensor:
        placements = [Replicate() if d is None else Shard(d) for d in self.dims]
        stride = torch.empty(self.shape, device="meta").stride()
        return DTensor.from_local(local, self.grid.device_mesh(self.order), placements, run_check=False,
                                  shape=torch.Size(self.shape), stride=stride)

    def local_slice(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's block of the logical tensor `full`, the local tensor of as_dtensor's DTensor: the mesh
        dims in order, each cutting its coordinate's equal piece of what those before it left (DTensor's
        nested Shard, outer to inner; the grid divides every split dim). A checkpoint's load under ZeRO,
        which reads whole tensors, cuts a grid block with it (tessel.train.checkpoint.logical.local_slice)."""
        piece = full
        for axis, dim in zip(self.order, self.dims):
            if dim is None:  # replicated along this axis (2.5D's depth)
                continue
            size = piece.size(dim) // self.grid.shape[axis]
            piece = piece.narrow(dim, self.grid.coords[axis] * size, size)
        return piece
