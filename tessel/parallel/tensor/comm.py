"""The communication of tensor and sequence parallelism, as named autograd functions.

Megatron-LM (Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion
Parameter Language Models Using Model Parallelism", section 3) brackets every
tensor-parallel region with a conjugate pair of operators:

    f: identity forward, all-reduce backward   (enter a region: CopyToTP)
    g: all-reduce forward, identity backward   (leave a region: ReduceFromTP)

Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation
Recomputation in Large Transformer Models", section 4.2.2) replaces the pair by
g / g-bar, which keep the activations between regions sharded along the
sequence dimension, with the same bytes on the wire as one all-reduce:

    g:     all-gather forward, reduce-scatter backward   (GatherSeq)
    g-bar: reduce-scatter forward, all-gather backward   (ReduceScatterSeq)

Gather and scatter along the last dimension (Megatron's
gather_from_tensor_model_parallel_region and its conjugate) serve layers whose
output must be whole, e.g. full-vocabulary logits for sampling.

Every function takes the tensor-parallel process group explicitly; a None group
(tp = 1) makes each of them the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# module names of their own: tessel.testing.grid_traffic records tp's collectives by rebinding these
from tessel.comm.algorithms import all_gather_single as _all_gather_single
from tessel.comm.algorithms import reduce_scatter_single as _reduce_scatter_single


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    if group is None:
        return x
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's x along `dim` (rank order)."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    flat = torch.empty((n * x.size(0), *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(flat, x.contiguous(), group=group)  # shards concatenated along dim 0
    stacked = flat.view(n, *x.shape)
    # (n, d0, .., d_dim, ..) -> (d0, .., n * d_dim, ..): shards are consecutive along dim
    return stacked.movedim(0, dim).flatten(dim, dim + 1)


def reduce_scatter_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum x over ranks and keep this rank's chunk along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    dim = dim % x.dim()
    if x.size(dim) % n:
        raise ValueError(f"dim {dim} of size {x.size(dim)} does not split over {n} ranks")
    # (.., n * c, ..) -> (n, .., c, ..): rank i's chunk becomes the i-th slab
    chunks = x.unflatten(dim, (n, -1)).movedim(dim, 0).contiguous()
    out = torch.empty(chunks.shape[1:], dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, chunks.flatten(0, 1), group=group)
    return out


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of x along `dim` (no communication)."""
    n = group_size(group)
    if n == 1:
        return x
    if x.size(dim) % n:
        raise ValueError(f"dim {dim} of size {x.size(dim)} does not split over {n} ranks")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


class CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient backward.

    Placed where a replicated activation enters column-parallel layers: each
    rank's gradient for it covers only its own output columns, so the partial
    gradients are summed. Applied to a parameter, it sums that parameter's
    partial gradients over the group (sequence-parallel norm weights).
    """

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        if torch.compiler.is_compiling():
            # a copy in a compiled graph (train.compile): where a view of an output that aliases the input
            # leaves the graph (a graph break follows), AOTAutograd rebuilds the view from the input and
            # this backward's all-reduce is lost (torch 2.13; tests/parallel/test_compile.py shows it)
            return x.clone()
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward, identity backward.

    Sums the partial outputs of a row-parallel layer (or of a vocab-parallel
    embedding); the gradient of a sum reaches every addend unchanged.
    """

    @staticmethod
    def forward(ctx, x, group):
        if x.is_contiguous() and x._base is None and not torch.compiler.is_compiling():
            # the input is a fresh matmul output that nothing saved: sum it in place (eagerly: dynamo traces
            # the all-reduce as a functional collective, and a compiled graph plans its own buffers)
            ctx.mark_dirty(x)
            return all_reduce(x, group)
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GatherLastDim(torch.autograd.Function):
    """Megatron's gather_from_tensor_model_parallel_region: all-gather along the
    last dim forward, keep this rank's slice of the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, -1, ctx.group), None


class ScatterLastDim(torch.autograd.Function):
    """Megatron's scatter_to_tensor_model_parallel_region: keep this rank's slice
    along the last dim forward, all-gather the gradient backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, -1, ctx.group), None


class GatherSeq(torch.autograd.Function):
    """Korthikanti et al.'s g: all-gather along the sequence dim forward,
    reduce-scatter of the gradient backward.

    Enters a tensor-parallel region from sequence-sharded activations: the
    column-parallel layers need the whole sequence, and their partial input
    gradients are summed and re-sharded by sequence in one collective.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_dim(grad, ctx.dim, ctx.group), None, None


class ReduceScatterSeq(torch.autograd.Function):
    """Korthikanti et al.'s g-bar: reduce-scatter along the sequence dim forward,
    all-gather of the gradient backward.

    Leaves a tensor-parallel region: the row-parallel partial outputs are summed
    and each rank keeps its sequence chunk, so norms and residuals that follow
    run on 1/tp of the tokens.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return reduce_scatter_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class ScatterSeq(torch.autograd.Function):
    """Split a replicated activation along the sequence dim forward (no
    communication), all-gather the gradient backward: Megatron's
    scatter_to_sequence_parallel_region."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return split_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim(grad, ctx.dim, ctx.group), None, None


class GatherSeqToReplica(torch.autograd.Function):
    """All-gather along the sequence dim forward, keep this rank's slice of the
    gradient backward: Megatron's gather_from_sequence_parallel_region with
    tensor_parallel_output_grad=False.

    For a module that every tp rank computes whole and alike on the gathered
    sequence (an MoE block under sequence parallelism): each rank's input
    gradient is then already the full one, so it is sliced, not summed. Its
    output goes back through ScatterSeq, whose all-gather backward gives every
    rank the whole output gradient.
    """

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return all_gather_dim(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, ctx.dim, ctx.group), None, None


def copy_to_tp(x, group):
    return x if group is None else CopyToTP.apply(x, group)


def reduce_from_tp(x, group):
    return x if group is None else ReduceFromTP.apply(x, group)


def gather_last_dim(x, group):
    return x if group is None else GatherLastDim.apply(x, group)


def scatter_last_dim(x, group):
    return x if group is None else ScatterLastDim.apply(x, group)


def gather_seq(x, dim, group):
    return x if group is None else GatherSeq.apply(x, dim, group)


def reduce_scatter_seq(x, dim, group):
    return x if group is None else ReduceScatterSeq.apply(x, dim, group)


def scatter_seq(x, dim, group):
    return x if group is None else ScatterSeq.apply(x, dim, group)


def gather_seq_to_replica(x, dim, group):
    return x if group is None else GatherSeqToReplica.apply(x, dim, group)
