"""Sequence parallelism's all-gather and reduce-scatter overlapped with the matmuls that use them.

Wang et al. 2023, "Overlap Communication with Dependent Computation via
Decomposition in Large Deep Learning Models" (ASPLOS '23, section 3): a
collective whose result feeds a matmul, or whose input a matmul makes, is
decomposed into tp point-to-point steps round a ring, and the matmul into the
tp pieces that each step carries, so that every piece computes while the next
one is on the wire. Under Megatron TP with sequence parallelism (Korthikanti
et al. 2022) that is:

    AllGatherLinear:      g (all-gather of the sequence) + the column-parallel
                          linears of a region; backward: their input gradient
                          as linears + reduce-scatter, the same ring reversed
    LinearReduceScatter:  the row-parallel linear + g-bar (reduce-scatter of
                          the sequence); backward: all-gather + linear

The ring passes sequence chunks (or running sums of them) to the next tp rank
with dist.isend / dist.irecv on the tp group; only the last step's piece has
nothing left to hide behind, so of the n - 1 transfers all but what outlasts
the pieces' compute is hidden (tessel.planner.pricing.tensor prices exactly
that). The results equal gather-then-matmul and matmul-then-reduce-scatter up
to the order of the reduce-scatter's fp32 sums.

Where a GPU with NCCL and several devices is available, torch's fused
symmetric-memory kernels (torch.distributed._symmetric_memory's
fused_all_gather_matmul / fused_matmul_reduce_scatter, torchtitan's async TP)
do the same decomposition with copy engines instead of host-driven sends:
the comparison to make there is step time and exposed communication of this
ring against those kernels on the same layout. They need CUDA and are not
built here (this machine has no GPU).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F


def _ring(group) -> tuple[int, int, int, int]:
    """(size, this rank, the next rank's and the previous rank's global ranks) of the tp ring."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    return n, r, dist.get_global_rank(group, (r + 1) % n), dist.get_global_rank(group, (r - 1) % n)


def ring_gather(shard: torch.Tensor, dim: int, group,
                piece: Callable[[int, torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, list]:
    """All-gather `shard` along `dim` round the ring, running piece(i, chunk_i) on each chunk as it
    arrives while the next one is in flight. Returns the gathered tensor (rank order) and, for each
    output of `piece`, its per-chunk results concatenated along `dim` (rank order)."""
    n, r, nxt, prv = _ring(group)
    chunks, outs = [None] * n, [None] * n
    cur = shard.contiguous()
    for step in range(n):
        src = (r - step) % n  # the rank whose chunk this is
        moving = []
        if step < n - 1:
            incoming = torch.empty_like(cur)
            moving = [dist.isend(cur, nxt, group=group), dist.irecv(incoming, prv, group=group)]
        chunks[src], outs[src] = cur, piece(src, cur)  # computes while the next chunk moves
        for work in moving:
            work.wait()
        if moving:
            cur = incoming
    return torch.cat(chunks, dim), [torch.cat(parts, dim) for parts in zip(*outs)]


def ring_reduce_scatter(partial: Callable[[int], torch.Tensor], group) -> torch.Tensor:
    """This rank's chunk of sum over ranks of partial(chunk), round the ring: at step s a rank makes
    its partial for chunk (rank - 1 - s) mod n while the running sum for it arrives from the previous
    rank, adds it, and sends the sum on; after n - 1 hops each sum is at the rank that owns its chunk.
    The sum for chunk d is added in ring order from rank d + 1 round to d (another order than a
    reduce-scatter collective's: fp32 rounding)."""
    n, r, nxt, prv = _ring(group)
    sends, acc = [], None
    for step in range(n):
        arriving = None
        if step > 0:
            incoming = torch.empty_like(acc)
            arriving = dist.irecv(incoming, prv, group=group)
        acc = partial((r - 1 - step) % n)  # computes while the running sum arrives
        if arriving is not None:
            arriving.wait()
            acc = incoming + acc
        if step < n - 1:
            sends.append(dist.isend(acc, nxt, group=group))
    for work in sends:
        work.wait()
    return acc


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(0, -2)


class AllGatherLinear(torch.autograd.Function):
    """g (the sequence all-gather) and the column-parallel linears of a region, decomposed round the
    ring (Wang et al. 2023, section 3): each linear runs on each arriving sequence chunk while the next
    one moves. Returns (gathered input, one output per linear).

    Backward is the conjugate pattern: the input gradient sum_i dy_i W_i (plus the gathered input's own
    gradient, when something else used it) is computed chunk by chunk and reduce-scattered round the
    ring; each chunk's weight gradients dy_i^T x run in the same step, adding compute to hide behind.
    The gathered input those need is kept from forward, not gathered again: it is a forward output the
    region's module holds anyway, and plain TP's linears keep it too, so memory is what it was without
    overlap (Megatron's re-gather in backward saves that memory at the price of a second ring).
    """

    @staticmethod
    def forward(ctx, x, dim, group, n_linear, *params):
        weights, biases = params[:n_linear], params[n_linear:]
        full, ys = ring_gather(x, dim, group,
                               lambda i, c: tuple(F.linear(c, w, b) for w, b in zip(weights, biases)))
        ctx.save_for_backward(full, *weights)
        ctx.dim, ctx.group, ctx.biased = dim, group, [b is not None for b in biases]
        ctx.set_materialize_grads(False)
        return (full, *ys)

    @staticmethod
    def backward(ctx, g_full, *g_ys):
        full, *weights = ctx.saved_tensors
        n, dim = dist.get_world_size(ctx.group), ctx.dim
        g_w = [None if g is None else torch.zeros_like(w) for g, w in zip(g_ys, weights)]

        def partial(d: int) -> torch.Tensor:
            x_d = full.chunk(n, dim)[d]
            part = torch.zeros_like(x_d) if g_full is None else g_full.chunk(n, dim)[d].clone()
            for i, (g, w) in enumerate(zip(g_ys, weights)):
                if g is not None:
                    g_d = g.chunk(n, dim)[d]
                    part += g_d @ w
                    g_w[i] += _rows(g_d).t() @ _rows(x_d)
            return part

        g_x = ring_reduce_scatter(partial, ctx.group)
        g_b = [_rows(g).sum(0) if g is not None and biased else None for g, biased in zip(g_ys, ctx.biased)]
        return (g_x, None, None, None, *g_w, *g_b)


class LinearReduceScatter(torch.autograd.Function):
    """The row-parallel linear and g-bar (the sequence reduce-scatter), decomposed round the ring
    (Wang et al. 2023, section 3): each rank computes its partial output for one destination chunk at
    a time and passes the running sum on while it computes the next.

    Backward is the conjugate pattern: the output gradient is all-gathered round the ring and each
    arriving chunk's input gradient (dy W) and weight gradient (dy^T x) computed while the next moves.
    """

    @staticmethod
    def forward(ctx, x, weight, dim, group):
        n = dist.get_world_size(group)
        ctx.save_for_backward(x, weight)
        ctx.dim, ctx.group = dim, group
        return ring_reduce_scatter(lambda d: F.linear(x.chunk(n, dim)[d], weight), group)

    @staticmethod
    def backward(ctx, g_y):
        x, weight = ctx.saved_tensors
        n, dim = dist.get_world_size(ctx.group), ctx.dim
        g_w = torch.zeros_like(weight)

        def piece(i: int, g_i: torch.Tensor) -> tuple[torch.Tensor]:
            g_w.add_(_rows(g_i).t() @ _rows(x.chunk(n, dim)[i]))
            return (g_i @ weight,)

        _, (g_x,) = ring_gather(g_y, dim, ctx.group, piece)
        return g_x, g_w, None, None


def _autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    kind = x.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def _cast(ts: Sequence[torch.Tensor | None], dtype: torch.dtype | None) -> list:
    return [t if t is None or dtype is None else t.to(dtype) for t in ts]


def gather_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], biases: Sequence[torch.Tensor | None],
                  dim: int, group) -> tuple[torch.Tensor, ...]:
    """(gathered x, F.linear(gathered x, w_i, b_i) for each i), overlapped; weights as F.linear's
    [out, in]. Under autocast the operands are cast first, as autocast casts a linear's, and the ring
    runs with autocast off, so that its backward sees one dtype throughout."""
    dtype = _autocast_dtype(x)
    x, = _cast([x], dtype)
    weights, biases = _cast(weights, dtype), _cast(biases, dtype)
    with torch.autocast(x.device.type, enabled=False):
        return AllGatherLinear.apply(x, dim, group, len(weights), *weights, *biases)


def linear_reduce_scatter(x: torch.Tensor, weight: torch.Tensor, dim: int, group) -> torch.Tensor:
    """reduce_scatter_seq(F.linear(x, weight)), overlapped; the weight as F.linear's [out, in]."""
    dtype = _autocast_dtype(x)
    x, weight = _cast([x, weight], dtype)
    with torch.autocast(x.device.type, enabled=False):
        return LinearReduceScatter.apply(x, weight, dim, group)


class OverlappedRegion:
    """The entry of a region of column-parallel layers under tp_overlap: in place of the all-gather g
    the region's input takes, one AllGatherLinear runs every column layer of the region on the arriving
    chunks. The module gets the gathered input (its code reads shapes from it) and each layer, when the
    module calls it on that input, returns the output already made (ColumnParallelLinear.forward).

    layers: the region's column layers, found at the first call (the plan swaps them in after the
    region's hook is set); each has `matmul_weight()`, `bias` and `pending`.
    """

    def __init__(self, layers: Callable[[], list], dim: int, group):
        self.find, self.layers, self.dim, self.group = layers, None, dim, group

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.layers is None:
            self.layers = self.find()
        full, *ys = gather_linear(x, [m.matmul_weight() for m in self.layers], [m.bias for m in self.layers],
                                  self.dim, self.group)
        for layer, y in zip(self.layers, ys):
            layer.pending = (full, y)
        return full
