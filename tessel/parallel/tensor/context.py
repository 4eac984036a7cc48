"""The tensor-parallel group as the layers and hooks of a plan see it."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessel.mesh import Mesh
from tessel.parallel.tensor import comm


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group as the layers see it. Activations are (B, T, C)."""
    group: object = None  # None when tp == 1
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    seq_dim: int = 1
    overlap: bool = False  # parallel.tp_overlap, under sequence parallelism only (tessel.parallel.tensor.overlap)

    @classmethod
    def from_mesh(cls, mesh: Mesh, sequence_parallel: bool = False, axis: str = "tp",
                  overlap: bool = False) -> "TPContext":
        group = mesh.group(axis)
        rank = dist.get_rank(group) if group is not None else 0
        sp = sequence_parallel and group is not None
        return cls(group, mesh.size(axis), rank, sp, overlap=overlap and sp)

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """Into a region of column-parallel layers: f, or g under sequence parallelism."""
        if self.sequence_parallel:
            return comm.gather_seq(x, self.seq_dim, self.group)
        return comm.copy_to_tp(x, self.group)

    def exit(self, x: torch.Tensor) -> torch.Tensor:
        """Out of a region (row-parallel partial sums): g, or g-bar under sequence parallelism."""
        if self.sequence_parallel:
            return comm.reduce_scatter_seq(x, self.seq_dim, self.group)
        return comm.reduce_from_tp(x, self.group)

    def padded(self, n: int) -> int:
        return -(-n // self.size) * self.size
