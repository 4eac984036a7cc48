"""2D tensor parallelism: SUMMA over a q x q grid (Xu et al. 2021, "An Efficient 2D
Method for Training Super-Large Deep Learning Models", the Optimus method, as in
Colossal-AI's legacy nn/layer/parallel_2d).

Layout on the grid (tessel.parallel.tensor_nd.grid: rank (i, j) is tp rank i*q + j):

- activations X (B, T, H): rank (i, j) holds X[batch chunk i, :, hidden chunk j],
  (B/q, T, H/q); tokens of one sequence stay together, so attention split by heads
  is local once the heads are split over j.
- a linear weight W (nn.Linear's [out, in]): rank (i, j) holds W[out chunk j,
  in chunk i]; Y = X W^T by SUMMA (Xu et al. Algorithm 1): q steps, each
  broadcasting a panel of X along the row and a panel of W^T along the column,
  then a local multiply-accumulate. Backward is the same algorithm for C = A B^T
  and C = A^T B, broadcast-multiply-reduce (Xu et al. section 3.2).
- an embedding table (V, H) and a norm's weight (H): split over the hidden dim
  into q^2 pieces, rank (i, j) holding piece j*q + i; a column all-gathers its
  pieces into hidden chunk j when it computes (backward: reduce-scatter, which
  also sums the gradients of the q batch chunks).
- logits (B, T, V): rank (i, j) holds [batch chunk i, :, vocab chunk j]; the loss
  is Megatron's vocab-parallel cross-entropy along the row, then averaged over the
  column's batch chunks: the full logits never exist on one rank.

Every parameter is split over all q^2 ranks (no replica inside the tp group), so
tessel's gradient norm sums it over tp like a 1D shard.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tessel.parallel.tensor import comm
from tessel.parallel.tensor.tensor_parallel import VocabParallelCrossEntropy
from tessel.parallel.tensor.tensor_parallel import _embed_scale as embed_scale_of
from tessel.parallel.tensor_nd.grid import Grid, GridPlacement, to_compute_dtype
from tessel.sharding import mark_replica, mark_sharded, set_placement


class Summa:
    """A 2D grid as SUMMA reads it: row i, column j, and the groups along each.

    A 2.5D grid (depth, q, q) is read the same within each depth layer k (Wang et al. 2021): the batch
    is split over depth x rows (chunk k*q + i), the weights are the same on every layer, and their
    gradients are summed over the depth group (reduce_over_depth)."""

    def __init__(self, grid: Grid, overlap: bool = False):
        self.grid, self.overlap = grid, overlap  # overlap: parallel.tp_overlap (each next panel prefetched)
        self.q = grid.shape[-1]
        self.i, self.j = grid.coords[-2], grid.coords[-1]
        self.row_group, self.col_group = grid.groups[-1], grid.groups[-2]  # same i over j; same j over i
        self.depth = grid.shape[0] if len(grid.shape) == 3 else 1
        self.k = grid.coords[0] if len(grid.shape) == 3 else 0
        self.depth_group = grid.groups[0] if len(grid.shape) == 3 else None
        # which slice of the batch this rank holds
        self.batch_chunk, self.batch_chunks = self.k * self.q + self.i, self.depth * self.q

    def shared(self, weight: torch.Tensor) -> torch.Tensor:
        """A weight as this layer's computation uses it: under 2.5D its gradient is summed over depth."""
        return weight if self.depth_group is None else reduce_over_depth(weight, self.depth_group)

    def row_src(self, k: int) -> int:
        return self.grid.src(len(self.grid.shape) - 1, k)  # rank (i, k)

    def col_src(self, k: int) -> int:
        return self.grid.src(len(self.grid.shape) - 2, k)  # rank (k, j)


def _bcast(x: torch.Tensor, mine: bool, src: int, group, async_op: bool = False):
    # a contiguous buffer: empty_like would copy a transposed weight's strides, and the collective
    # writes the bytes in row-major order
    buf = x.contiguous() if mine else x.new_empty(x.shape)
    work = dist.broadcast(buf, src=src, group=group, async_op=async_op)
    return (buf, work) if async_op else buf


def _panels(specs: Callable[[int], list[tuple]], s: Summa) -> Iterator[list[torch.Tensor]]:
    """The broadcast panels of each of SUMMA's q steps; specs(k) lists step k's broadcasts as
    (tensor, mine, src, group). Under s.overlap, step k + 1's broadcasts are in flight while step k's
    panels multiply: the decomposition of Wang et al. 2023 ("Overlap Communication with Dependent
    Computation via Decomposition", ASPLOS '23) applied to SUMMA's broadcasts, which are already one
    per step; one step's panels at a time per group, so every rank issues them in the same order."""
    if not s.overlap:
        for k in range(s.q):
            yield [_bcast(*spec) for spec in specs(k)]
        return
    ahead = [_bcast(*spec, async_op=True) for spec in specs(0)]
    for k in range(s.q):
        for _, work in ahead:
            work.wait()
        panels = [buf for buf, _ in ahead]
        if k + 1 < s.q:
            ahead = [_bcast(*spec, async_op=True) for spec in specs(k + 1)]
        yield panels


def summa_ab(a: torch.Tensor, b: torch.Tensor, s: Summa) -> torch.Tensor:
    """C_ij = sum_k A_ik B_kj: broadcast A_ik along row i, B_kj along column j, multiply-accumulate."""
    c = a.new_zeros(a.size(0), b.size(1))
    steps = _panels(lambda k: [(a, s.j == k, s.row_src(k), s.row_group), (b, s.i == k, s.col_src(k), s.col_group)],
                    s)
    for a_k, b_k in steps:
        c.addmm_(a_k, b_k)
    return c


def summa_abt(a: torch.Tensor, b: torch.Tensor, s: Summa) -> torch.Tensor:
    """C_ij = sum_m A_im B_jm^T: for each target column k, broadcast B_kj down column j, multiply,
    reduce the partial products along row i onto rank (i, k)."""
    out = None
    for k, (b_k,) in enumerate(_panels(lambda k: [(b, s.i == k, s.col_src(k), s.col_group)], s)):
        part = a @ b_k.t()
        dist.reduce(part, dst=s.row_src(k), group=s.row_group)
        if s.j == k:
            out = part
    return out


def summa_atb(a: torch.Tensor, b: torch.Tensor, s: Summa) -> torch.Tensor:
    """C_ij = sum_n A_ni^T B_nj: for each target row k, broadcast A_nk along row n, multiply,
    reduce the partial products down column j onto rank (k, j)."""
    out = None
    for k, (a_k,) in enumerate(_panels(lambda k: [(a, s.j == k, s.row_src(k), s.row_group)], s)):
        part = a_k.t() @ b
        dist.reduce(part, dst=s.col_src(k), group=s.col_group)
        if s.i == k:
            out = part
    return out


class SummaMatmul(torch.autograd.Function):
    """Y = X W on a q x q grid by SUMMA (Xu et al. 2021, Algorithm 1; Colossal-AI's Matmul_AB_2D).

    Forward: q broadcast steps of X's panel along the row and W's along the column. Backward
    (Xu et al. section 3.2): dX = dY W^T (Matmul_ABT_2D) and dW = X^T dY (Matmul_ATB_2D), each q
    steps of broadcast, local multiply and reduce onto the panel's owner.
    """

    @staticmethod
    def forward(ctx, x, w, s: Summa):
        ctx.save_for_backward(x, w)
        ctx.summa = s
        return summa_ab(x, w, s)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        return summa_abt(grad, w, ctx.summa), summa_atb(x, grad, ctx.summa), None


class SummaMatmulTransposed(torch.autograd.Function):
    """Y = X B^T on a q x q grid, B's block (i, j) being B[row chunk i, column chunk j] (Xu et al. 2021, section
    3.2's C = A B^T, Colossal-AI's Matmul_ABT_2D, as the forward): the tied output head multiplies by the token
    table this way, its rows (the vocabulary) split like the logits' columns. Backward: dX = dY B (SUMMA's
    A B) and dB = dY^T X (A^T B)."""

    @staticmethod
    def forward(ctx, x, b, s: Summa):
        ctx.save_for_backward(x, b)
        ctx.summa = s
        return summa_abt(x, b, s)

    @staticmethod
    def backward(ctx, grad):
        x, b = ctx.saved_tensors
        grad = grad.contiguous()
        return summa_ab(grad, b, ctx.summa), summa_atb(grad, x, ctx.summa), None


def gather_column(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """All-gather a parameter's q pieces down the grid's column (forward), reduce-scatter its gradient
    (backward): Colossal-AI's all_gather_tensor_2d / reduce_scatter_tensor_2d for the 2D embedding and
    norm weights (Xu et al. 2021). The reduce-scatter also sums the gradients of the column's q batch
    chunks. The same collective pair as Megatron-SP's g along the sequence (tessel.parallel.tensor.comm)."""
    return comm.gather_seq(x, dim, group)


class SumOverRow(torch.autograd.Function):
    """All-reduce over the row forward and backward: a statistic over the whole hidden dim (the norm's
    sum of squares) that every rank of the row uses, so each use's gradient reaches every addend."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return comm.all_reduce(grad.clone(), ctx.group), None


def reduce_over_depth(w: torch.Tensor, group) -> torch.Tensor:
    """Tesseract's weight replication (Wang et al. 2021, "2.5-dimensional distributed model training",
    section 3): every depth layer of the q x q x d grid holds the same weight blocks and multiplies its
    own batch slice by them; identity forward, all-reduce of the gradient over the depth group backward:
    Megatron's f applied to a parameter (tessel.parallel.tensor.comm.CopyToTP)."""
    return comm.copy_to_tp(w, group)


class MeanOverColumn(torch.autograd.Function):
    """The mean of the group's per-batch-chunk losses on every rank (all-reduce / n forward). Backward
    hands each rank 1/n of the gradient: every rank's copy is the same one scalar of the whole batch."""

    @staticmethod
    def forward(ctx, x, group, n):
        ctx.n = n
        return comm.all_reduce(x.clone(), group) / n

    @staticmethod
    def backward(ctx, grad):
        return grad / ctx.n, None, None


# ---- layers ---------------------------------------------------------------------

def _param(data: torch.Tensor, s: Summa, full: torch.Tensor, by_i: int, by_j: int,
           j_outer: bool = False) -> nn.Parameter:
    """A parameter holding `data`, this rank's block of `full`: tensor dim by_i split over the grid's rows
    (i), by_j over its columns (j); when both split one dim, j_outer says j's chunks hold i's pieces."""
    p = nn.Parameter(data.detach().clone().contiguous())
    mark_sharded(p, "tp")  # a block of a 2D split: no single tensor dim (full_tensors gathers it)
    rank = len(s.grid.shape)
    i_axis, j_axis = rank - 2, rank - 1
    order, dims = ((j_axis, i_axis), (by_j, by_i)) if j_outer else ((i_axis, j_axis), (by_i, by_j))
    if rank == 3:  # 2.5D: the same block on every depth layer
        order, dims = (0, *order), (None, *dims)
    set_placement(p, GridPlacement(s.grid, order, dims, tuple(full.shape)))
    if s.k > 0:
        mark_replica(p)  # 2.5D: depth layer 0's copy is the one the gradient norm counts
    return p


def scaled(rows: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """Looked-up rows times a scaled word embedding's factor, as transformers' ScaledWordEmbedding.forward."""
    return rows if scale is None else rows * scale.to(rows.dtype)


def hidden_piece(full: torch.Tensor, s: Summa, dim: int = -1) -> torch.Tensor:
    """Piece j*q + i of q^2 along `dim` (the embedding's and norms' split)."""
    return full.chunk(s.q, dim=dim)[s.j].chunk(s.q, dim=dim)[s.i]


def gather_block(t: torch.Tensor, s: Summa) -> torch.Tensor:
    """A linear weight (or its gradient) whole from the blocks [out chunk j, in chunk i]; collective."""
    rows = comm.all_gather_dim(t.detach().contiguous(), 0, s.row_group)  # the j blocks: [out, in/q]
    return comm.all_gather_dim(rows, 1, s.col_group)  # the i blocks: [out, in]


def gather_pieces(t: torch.Tensor, s: Summa, dim: int = -1) -> torch.Tensor:
    """A tensor split in q^2 hidden pieces (piece j*q + i) whole again; collective."""
    chunk = comm.all_gather_dim(t.detach().contiguous(), dim, s.col_group)  # pieces of chunk j, by i
    return comm.all_gather_dim(chunk, dim, s.row_group)  # the chunks, by j


class Linear2D(nn.Module):
    """nn.Linear on the grid: rank (i, j) keeps weight[out chunk j, in chunk i]. A bias (Hugging Face families'
    q/k/v, GPT-NeoX's every projection) is split like a norm's weight, in q^2 pieces of the output features,
    and gathered down the column for output chunk j (backward: reduce-scatter, which sums the batch chunks)."""

    def __init__(self, linear: nn.Linear, s: Summa):
        super().__init__()
        self.s = s
        self.in_features, self.out_features = linear.in_features, linear.out_features
        block = linear.weight.chunk(s.q, 0)[s.j].chunk(s.q, 1)[s.i]  # [out/q, in/q]
        self.weight = _param(block, s, linear.weight, 1, 0)
        self.bias = None if linear.bias is None else \
            _param(hidden_piece(linear.bias, s), s, linear.bias, 0, 0, j_outer=True)  # (out/q^2,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2d, w = to_compute_dtype(x.flatten(0, -2)), to_compute_dtype(self.s.shared(self.weight).t())
        y = SummaMatmul.apply(x2d, w, self.s)  # (N, out/q)
        if self.bias is not None:
            y = y + to_compute_dtype(gather_column(self.s.shared(self.bias), 0, self.s.col_group))  # (out/q,)
        return y.view(*x.shape[:-1], -1)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return gather_block(t, self.s)

    def full_bias(self, t: torch.Tensor) -> torch.Tensor:
        return gather_pieces(t, self.s, 0)

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features}, grid={self.s.q}x{self.s.q}, "
                f"at=({self.s.i}, {self.s.j})")


class Embedding2D(nn.Module):
    """The token table split over the hidden dim in q^2 pieces; rank (i, j) looks up batch chunk i's
    ids in hidden chunk j (gathered down the column)."""

    def __init__(self, emb: nn.Embedding, s: Summa):
        super().__init__()
        self.s, self.padding_idx = s, emb.padding_idx  # a padding row gets no gradient (Hugging Face Llama's)
        self.weight = _param(hidden_piece(emb.weight, s), s, emb.weight, 1, 1, j_outer=True)  # (V, H/q^2)
        # transformers' scaled word embeddings (Gemma's sqrt(hidden)): its factor, under its own buffer name
        self.register_buffer("embed_scale", embed_scale_of(emb), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        table = gather_column(self.s.shared(self.weight), -1, self.s.col_group)  # (V, H/q)
        mine = idx.chunk(self.s.batch_chunks, dim=0)[self.s.batch_chunk]  # (B/q, T)
        return scaled(F.embedding(mine, table, self.padding_idx), self.embed_scale)  # (B/q, T, H/q)

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return gather_pieces(t, self.s, -1)


class TiedHead2D(nn.Module):
    """The output head tied to the token embedding (model.tie_embeddings): Y = X E^T. Rank (i, j) gathers the
    table's hidden chunk j down its column, as the embedding does, and multiplies by its rows of vocabulary
    chunk i (SummaMatmulTransposed): the logits come out as a Linear2D head's, [batch chunk i, vocab chunk j].
    No parameter of its own: the gradient reaches the embedding's pieces through the gather's reduce-scatter."""

    def __init__(self, embedding: Embedding2D, s: Summa):
        super().__init__()
        self.s = s
        self._embedding = (embedding,)  # not a submodule: the table is the embedding's parameter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.s
        table = gather_column(s.shared(self._embedding[0].weight), -1, s.col_group)  # (V, H/q)
        rows = table.chunk(s.q, 0)[s.i]  # (V/q, H/q): vocabulary chunk i of hidden chunk j
        y = SummaMatmulTransposed.apply(to_compute_dtype(x.flatten(0, -2)), to_compute_dtype(rows), s)  # (N, V/q)
        return y.view(*x.shape[:-1], -1)


class RMSNorm2D(nn.Module):
    """RMSNorm over hidden chunks: the sum of squares is summed along the row (SumOverRow). Any RMSNorm whose
    weight scales the normalised input (torch's, Hugging Face Llama's), its epsilon given."""

    def __init__(self, norm: nn.Module, s: Summa, hidden: int, eps: float):
        super().__init__()
        self.s, self.hidden, self.eps = s, hidden, eps
        self.weight = _param(hidden_piece(norm.weight, s), s, norm.weight, 0, 0, j_outer=True)  # (H/q^2,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sq = SumOverRow.apply(x.pow(2).sum(-1, keepdim=True), self.s.row_group)
        gamma = gather_column(self.s.shared(self.weight), 0, self.s.col_group)  # (H/q,)
        return x * torch.rsqrt(sq / self.hidden + self.eps) * gamma

    def full(self, t: torch.Tensor) -> torch.Tensor:
        return gather_pieces(t, self.s, 0)


class Loss2D:
    """loss_fn(logits [batch chunk i, vocab chunk j], targets (B, T) whole): the vocab-parallel
    cross-entropy along the row, averaged over the batch chunks (the column's, then the depth's)."""

    def __init__(self, s: Summa, vocab_size: int):
        self.s, self.vocab_size = s, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        s = self.s
        mine = targets.chunk(s.batch_chunks, dim=0)[s.batch_chunk]
        start = s.j * logits.size(-1)
        local = VocabParallelCrossEntropy.apply(logits.flatten(0, -2), mine.flatten(), start, self.vocab_size,
                                                s.row_group)
        loss = MeanOverColumn.apply(local, s.col_group, s.q)
        return loss if s.depth_group is None else MeanOverColumn.apply(loss, s.depth_group, s.depth)


class FullLogits2D:
    """model(idx) -> logits over the whole vocabulary for sampling: the prompt is repeated so that every
    batch chunk holds all of it, and the vocab chunks are gathered along the row."""

    def __init__(self, model: nn.Module, s: Summa):
        self.model, self.s = model, s

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        logits = self.model(idx.repeat(self.s.batch_chunks, 1))  # this rank's chunk: the whole prompt
        return comm.all_gather_dim(logits.contiguous(), -1, self.s.row_group)
