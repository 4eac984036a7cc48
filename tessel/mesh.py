"""One device mesh with named axes, passed explicitly to everything that talks.

Ranks are laid out on a grid whose axes are named (pp, dp, ep, cp, tp). The
default order puts tp innermost, so a tensor-parallel group is a run of
contiguous ranks (one node), cp next to it (tessel.axes), and pp outermost, so
pipeline stages cross nodes (Narayanan et al. 2021, "PTD-P"). Process groups
are created once, for every single axis and for the axis combinations that the
strategies need; nothing is kept in module globals.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from tessel.axes import AXES, TOKEN_AXES, full_order

# Combinations that strategies reduce over: non-expert gradients over dp x ep,
# the global gradient norm over everything that shards parameters; losses and replicated
# gradients over every axis whose ranks see different tokens (tessel.axes.TOKEN_AXES); an
# expert's (sharded over ep) over the token axes that replicate it, which ZeRO shards it over
# (made here, by every rank: a pipeline stage without experts must take part in its creation too).
EXPERT_AXES = tuple(a for a in TOKEN_AXES if a != "ep")
DEFAULT_COMBOS = (("dp", "ep"), TOKEN_AXES, EXPERT_AXES)


@dataclass
class Mesh:
    sizes: dict[str, int]
    order: tuple[str, ...] = AXES
    rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _groups: dict[tuple[str, ...], object] = field(default_factory=dict, repr=False)
    _members: dict[tuple[str, ...], list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        # sizes and orders written before an axis existed (cp) give it size 1 and its default place
        self.sizes = {a: int(self.sizes.get(a, 1)) for a in AXES}
        self.order = full_order(self.order)

    # ---- layout (pure arithmetic, no process group needed) -----------------
    @property
    def world_size(self) -> int:
        n = 1
        for a in self.order:
            n *= self.sizes[a]
        return n

    def grid(self) -> torch.Tensor:
        """Global ranks as a tensor indexed by AXES, whatever the rank order."""
        shape = [self.sizes[a] for a in self.order]
        ranks = torch.arange(self.world_size).reshape(shape)
        return ranks.permute([self.order.index(a) for a in AXES])

    def coords(self, rank: int | None = None) -> dict[str, int]:
        rank = self.rank if rank is None else rank
        idx = (self.grid() == rank).nonzero()[0].tolist()
        return dict(zip(AXES, idx))

    def coord(self, axis: str) -> int:
        return self.coords()[axis]

    def size(self, *axes: str) -> int:
        n = 1
        for a in axes:
            n *= self.sizes[a]
        return n

    def group_ranks(self, axes: Sequence[str], rank: int | None = None) -> list[int]:
        """Global ranks that share every coordinate except `axes` with `rank`."""
        mine = self.coords(rank)
        index = tuple(slice(None) if a in axes else mine[a] for a in AXES)
        sub = self.grid()[index]
        keep = [a for a in AXES if a in axes]
        want = [keep.index(a) for a in axes]  # order members by the axes as given
        return sub.permute(want).reshape(-1).tolist()

    def all_groups(self, axes: Sequence[str]) -> list[list[int]]:
        seen, out = set(), []
        for r in range(self.world_size):
            g = tuple(self.group_ranks(axes, r))
            if g not in seen:
                seen.add(g)
                out.append(list(g))
        return out

    # ---- process groups -----------------------------------------------------
    def group(self, *axes: str):
        """The process group over `axes` containing this rank (None if size 1)."""
        key = tuple(axes)
        if self.size(*axes) == 1:
            return None
        if key not in self._groups:
            raise KeyError(f"no process group for axes {key}; call mesh.build_groups({key!r})")
        return self._groups[key]

    def local_rank_in(self, *axes: str) -> int:
        return self.group_ranks(axes).index(self.rank)

    def build_groups(self, combos: Iterable[Sequence[str]] = ()) -> "Mesh":
        """Create groups for every axis and each combo. Collective: all ranks call it."""
        wanted = [(a,) for a in AXES] + [tuple(c) for c in DEFAULT_COMBOS] + [tuple(c) for c in combos]
        # also the full model-parallel set used by the gradient norm
        wanted.append(tuple(a for a in AXES))
        for key in dict.fromkeys(wanted):
            if key in self._groups or self.size(*key) == 1:
                continue
            for ranks in self.all_groups(key):
                g = dist.new_group(ranks)  # every rank takes part in every creation
                if self.rank in ranks:
                    self._groups[key] = g
                    self._members[key] = ranks
        return self

    def describe(self) -> str:
        lines = [f"mesh {' x '.join(f'{a}={self.sizes[a]}' for a in AXES)} "
                 f"(rank order {'>'.join(self.order)}, world {self.world_size})"]
        for a in AXES:
            if self.sizes[a] > 1:
                lines.append(f"  {a} groups: {self.all_groups((a,))}")
        return "\n".join(lines)

    def check_topology(self, nproc_per_node: int | None) -> list[str]:
        """Warn if a tensor- or context-parallel group straddles nodes (their traffic is per layer)."""
        if not nproc_per_node:
            return []
        msgs = []
        for axis in ("tp", "cp"):
            for g in self.all_groups((axis,)) if self.sizes[axis] > 1 else []:
                if len({r // nproc_per_node for r in g}) > 1:
                    msgs.append(f"{axis} group {g} spans nodes (nproc_per_node={nproc_per_node})")
        for m in msgs:
            warnings.warn(m, stacklevel=2)
        return msgs


def make_mesh(sizes: dict[str, int], order: Sequence[str] = AXES, rank: int | None = None,
              device: torch.device | None = None, build: bool = True) -> Mesh:
    full = {a: int(sizes.get(a, 1)) for a in AXES}
    unknown = set(sizes) - set(AXES)
    if unknown:
        raise ValueError(f"unknown mesh axes {sorted(unknown)}; known: {AXES}")
    mesh = Mesh(full, tuple(order), rank if rank is not None else (dist.get_rank() if dist.is_initialized() else 0),
                device or torch.device("cpu"))  # Mesh gives an order written before cp its place
    if dist.is_initialized() and mesh.world_size != dist.get_world_size():
        raise ValueError(f"mesh size {mesh.world_size} != world size {dist.get_world_size()}")
    if build and dist.is_initialized():
        mesh.build_groups()
    return mesh

