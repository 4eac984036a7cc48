"""3D tensor parallelism over a c x c x c cube (Bian et al. 2021, "Maximizing Parallelism in
Distributed Training for Huge Neural Networks", as in Colossal-AI's legacy nn/layer/parallel_3d).

Cube coordinates (a, b, e) of tp rank a*c*c + b*c + e (tessel.parallel.tensor_nd.grid), with a
process group along each axis. An activation X (rows = batch, cols = hidden) has a layout L(s, r),
{s, r} = {1, 2} (the b and e axes): rank (a, b, e) holds the rows of batch chunk a*c + coord[s] and
the hidden chunk coord[r]. Nothing is replicated: every rank holds 1/c^3 of every tensor.

A linear layer on L(s, r) (Bian et al. section 3.1: input, weight and output on three different
faces of the cube):
  1. all-gather X over axis s (rows): X[batch chunk a, hidden chunk coord[r]]      (gather_cube)
  2. all-gather W's pieces over axis 0: W[out chunk coord[s], in chunk coord[r]]  (gather_cube)
  3. multiply locally: a partial sum over the in chunks, i.e. over axis r
  4. reduce-scatter the partial outputs over axis r (rows): layout L(r, s)         (reduce_scatter_cube)
Backward mirrors it (all-gather of dY over r; dX and dW reduce-scattered over s and 0).
The output's layout swaps the two axes, so the layers that read the residual stream (q, k, v,
gate, up, the head) take L(2, 1) to L(1, 2) and those that write it (wo, down) take L(1, 2) back.

Norms and the embedding table split their hidden dim over axis 1 (the stream's L(2, 1)) and store
each chunk in c*c pieces over axes (0, 2), gathered when used. The loss is the vocab-parallel
cross-entropy along axis 2 (the head's output is L(1, 2)), averaged over the c*c batch chunks.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessel.parallel.tensor import comm
from tessel.parallel.tensor.tensor_parallel import VocabParallelCrossEntropy
from tessel.parallel.tensor_nd.grid import Grid, GridPlacement, to_compute_dtype
from tessel.parallel.tensor_nd.summa import MeanOverColumn, SumOverRow, embed_scale_of, scaled
from tessel.sharding import mark_sharded, set_placement

STREAM = (2, 1)  # the residual stream's layout L(s, r)
MIXED = (1, 2)  # between a pair of linear layers (attention heads, the SwiGLU's hidden)
HIDDEN_ORDER = (1, 0, 2)  # a norm's or the embedding's hidden dim: chunk on axis 1, pieces on axes 0 then 2


def gather_cube(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather along `dim` over one axis of the cube forward, reduce-scatter backward (Bian et al.
    2021, section 3.1: the input and the weight reach the face where they are multiplied); the
    collective pair of Megatron-SP's g (tessel.parallel.tensor.comm.GatherSeq)."""
    return comm.gather_seq(x, dim, group)


def reduce_scatter_cube(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Reduce-scatter along `dim` over one axis of the cube forward, all-gather backward (Bian et al.
    2021, section 3.1: the partial products are summed onto the output face, split by rows); the
    collective pair of Megatron-SP's g-bar (tessel.parallel.tensor.comm.ReduceScatterSeq)."""
    return comm.reduce_scatter_seq(x, dim, group)


class Cube:
    """This rank on the cube: its coordinates and the group along each axis."""

    def __init__(self, grid: Grid):
        self.grid, self.c, self.coords, self.groups = grid, grid.shape[0], grid.coords, grid.groups

    def batch_chunk(self, layout: tuple[int, int]) -> int:
        return self.coords[0] * self.c + self.coords[layout[0]]


def _param(data: torch.Tensor, cube: Cube, full: torch.Tensor, order: tuple[int, ...],
           dims: tuple[int, ...]) -> nn.Parameter:
    """A parameter holding `data`, this rank's piece of `full`: the cube's axes in `order` split the tensor
    dims `dims`, outer to inner where two split the same dim (a DTensor placement for checkpoints)."""
    p = nn.Parameter(data.detach().clone().contiguous())
    mark_sharded(p, "tp")  # a piece of a 3D split: no single tensor dim (full_tensors gathers it)
    set_placement(p, GridPlacement(cube.grid, order, dims, tuple(full.shape)))
    return p


def _gather(t: torch.Tensor, dim: int, group) -> torch.Tensor:
    return comm.all_gather_dim(t.detach().contiguous(), dim, group)


class Linear3D(nn.Module):
    """nn.Linear (no bias) on the cube, input in layout `layout` = L(s, r), output in L(r, s)."""

    def __init__(self, linear: nn.Linear, cube: Cube, layout: tuple[int, int]):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("3D linear layers take no bias (not built yet; 2D and 2.5D split them)")
        self.cube, self.layout = cube, layout
        s, r = layout
        c, at = cube.c, cube.coords
        block = linear.weight.chunk(c, 0)[at[s]].chunk(c, 1)[at[r]]  # [out chunk s, in chunk r]
        self.weight = _param(block.chunk(c, 0)[at[0]], cube, linear.weight, (s, 0, r), (0, 0, 1))  # piece on axis 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, r = self.layout
        g = self.cube.groups
        x = gather_cube(to_compute_dtype(x), 0, g[s])  # (B/c, T, in/c)
        w = gather_cube(to_compute_dtype(self.weight), 0, g[0])  # [out/c, in/c]
        return reduce_scatter_cube(F.linear(x, w), 0, g[r])  # (B/c^2, T, out/c), layout L(r, s)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        s, r = self.layout
        g = self.cube.groups
        return _gather(_gather(_gather(t, 0, g[0]), 0, g[s]), 1, g[r])


def _hidden_piece(full: torch.Tensor, cube: Cube) -> torch.Tensor:
    """Hidden chunk coord[1] of `full`'s last dim, in c*c pieces over axes (0, 2)."""
    c, at = cube.c, cube.coords
    return full.chunk(c, -1)[at[1]].chunk(c, -1)[at[0]].chunk(c, -1)[at[2]]


def _gather_hidden(w: torch.Tensor, cube: Cube) -> torch.Tensor:
    """The pieces of hidden chunk coord[1], with autograd (backward sums the users' gradients)."""
    return gather_cube(gather_cube(w, -1, cube.groups[2]), -1, cube.groups[0])


def _full_hidden(t: torch.Tensor, cube: Cube) -> torch.Tensor:
    g = cube.groups
    return _gather(_gather(_gather(t, -1, g[2]), -1, g[0]), -1, g[1])


class Embedding3D(nn.Module):
    """The token table, hidden chunk coord[1] gathered from its pieces; looks up this rank's batch chunk."""

    def __init__(self, emb: nn.Embedding, cube: Cube):
        super().__init__()
        self.cube, self.padding_idx = cube, emb.padding_idx  # a padding row gets no gradient
        self.weight = _param(_hidden_piece(emb.weight, cube), cube, emb.weight, HIDDEN_ORDER, (1, 1, 1))  # (V, H/c^3)
        self.register_buffer("embed_scale", embed_scale_of(emb), persistent=False)  # Gemma's sqrt(hidden)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        mine = idx.chunk(self.cube.c ** 2, dim=0)[self.cube.batch_chunk(STREAM)]
        rows = F.embedding(mine, _gather_hidden(self.weight, self.cube), self.padding_idx)  # (B/c^2, T, H/c)
        return scaled(rows, self.embed_scale)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return _full_hidden(t, self.cube)


class TiedHead3D(nn.Module):
    """The output head tied to the token embedding on the cube: the table's hidden chunk coord[1], gathered as
    the embedding gathers it, holds the rows of the head's block [vocab chunk coord[2], hidden chunk coord[1]]
    (a Linear3D head's on L(2, 1)): no further communication for the weight; the input gathered and the
    output reduce-scattered as Linear3D does. No parameter of its own."""

    def __init__(self, embedding: Embedding3D, cube: Cube):
        super().__init__()
        self.cube = cube
        self._embedding = (embedding,)  # not a submodule: the table is the embedding's parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, r = STREAM
        cube, g = self.cube, self.cube.groups
        table = _gather_hidden(self._embedding[0].weight, cube)  # (V, H/c)
        w = table.chunk(cube.c, 0)[cube.coords[s]]  # (V/c, H/c)
        x = gather_cube(to_compute_dtype(x), 0, g[s])  # (B/c, T, H/c)
        return reduce_scatter_cube(F.linear(x, to_compute_dtype(w)), 0, g[r])  # (B/c^2, T, V/c), L(1, 2)


class RMSNorm3D(nn.Module):
    """RMSNorm on the stream's layout: the sum of squares summed over axis 1 (the hidden chunks)."""

    def __init__(self, norm: nn.Module, cube: Cube, hidden: int, eps: float):
        super().__init__()
        self.cube, self.hidden, self.eps = cube, hidden, eps
        self.weight = _param(_hidden_piece(norm.weight, cube), cube, norm.weight, HIDDEN_ORDER, (0, 0, 0))  # (H/c^3,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sq = SumOverRow.apply(x.pow(2).sum(-1, keepdim=True), self.cube.groups[STREAM[1]])
        return x * torch.rsqrt(sq / self.hidden + self.eps) * _gather_hidden(self.weight, self.cube)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return _full_hidden(t, self.cube)


class Loss3D:
    """The vocab-parallel cross-entropy over axis 2 of the head's L(1, 2) logits, averaged over the
    batch chunks (axes 0 and 1)."""

    def __init__(self, cube: Cube, vocab_size: int):
        self.cube, self.vocab_size = cube, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        cube, (s, r) = self.cube, MIXED
        mine = targets.chunk(cube.c ** 2, dim=0)[cube.batch_chunk(MIXED)]
        start = cube.coords[r] * logits.size(-1)
        loss = VocabParallelCrossEntropy.apply(logits.flatten(0, -2), mine.flatten(), start, self.vocab_size,
                                               cube.groups[r])
        loss = MeanOverColumn.apply(loss, cube.groups[s], cube.c)
        return MeanOverColumn.apply(loss, cube.groups[0], cube.c)


class FullLogits3D:
    """Whole-vocabulary logits for sampling: the prompt repeated into every batch chunk, vocab gathered."""

    def __init__(self, model: nn.Module, cube: Cube):
        self.model, self.cube = model, cube

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx.repeat(self.cube.c ** 2, 1))
        return comm.all_gather_dim(logits.contiguous(), -1, self.cube.groups[MIXED[1]])
