"""What a grid computes whole along the hidden dim: a Hugging Face family's modules that no grid layer replaces.

On a grid an activation is split twice, by batch chunks and by hidden chunks (tessel.parallel.tensor_nd.summa,
.cube). The grid layers (linear, embedding, RMSNorm) compute on those pieces; a module of any other kind, which
a Hugging Face plan leaves whole (a norm with a bias or a (1 + w) scale, a region whose projections the plan
gathers, a per-head norm), runs here as the module itself, unmodified, on the hidden dim made whole by the group
that splits it (HiddenSplit), the same way on every rank of that group:

- a norm whose output is not the grid's RMSNorm (norm_whole): its input gathered whole over the hidden split, its
  own forward, this rank's hidden chunk of the output;
- a region whose column layers gather their outputs (transformers' colwise_gather_output, then
  rowwise_split_input: Phi-3's and GLM-4's fused gate|up, OLMo 2's q/k norms): the output gathered whole over the
  hidden split (backward: this rank's slice, as Megatron's gather), the row layer's input cut back to this rank's
  chunk (backward: all-gathered); every rank of the split then computes the same region on the same tensor;
- a module each rank applies to its own heads (transformers' replicated_with_grad_allreduce: Qwen3's q/k norms);
- an MoE block (block_whole), computed whole on every tp rank as 1D computes it: on the whole micro-batch.

Their weights stay whole on every rank (a few hidden-sized vectors) and unmarked, so the gradient norm counts them
once: each rank's gradient is its share (its batch chunk, its hidden chunk or heads), so it is all-reduced over
the groups whose shares differ before it accumulates (tessel.parallel.tensor.regions' hooks, on grid groups).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.func import functional_call

from tessel.parallel.tensor import comm
from tessel.parallel.tensor.regions import on_input


@dataclass(frozen=True)
class HiddenSplit:
    """How a grid splits one layout of an activation: the group over the hidden chunks (this rank's chunk is its
    index there) and the groups over the batch chunks, inner first (batch chunk = outer * size(inner) + inner;
    None entries: a grid axis of size 1)."""
    hidden_group: object
    batch_groups: tuple[object, ...]

    @property
    def all_groups(self) -> tuple[object, ...]:
        return (self.hidden_group, *self.batch_groups)


def sum_grads(module: nn.Module, groups: tuple[object, ...]) -> None:
    """Each parameter's gradient all-reduced over `groups` before it accumulates: the shares of a weight every
    rank holds whole and applies to its own part of the activations."""
    for p in module.parameters():
        p.register_hook(partial(_summed, groups=groups))


def _summed(grad: torch.Tensor, groups: tuple[object, ...]) -> torch.Tensor:
    grad = grad.clone()  # a hook must not change the tensor it is given
    for group in groups:
        grad = comm.all_reduce(grad, group)
    return grad


def norm_whole(norm: nn.Module, split: HiddenSplit) -> None:
    """Any per-token norm on a grid, unmodified: its input gathered whole over the hidden split (forward
    all-gather; backward reduce-scatter, which sums the shares of the ranks that used it), this rank's hidden
    chunk of its output. Its weights stay whole (gradients summed over the tp group); names unchanged."""
    group = split.hidden_group
    on_input(norm, lambda x: comm.gather_seq(x, -1, group))
    # each rank keeps its chunk: the gradient of the whole output reaches the norm through that chunk only
    norm.register_forward_hook(lambda mod, args, out: comm.split_dim(out, -1, group))
    sum_grads(norm, split.all_groups)


def computes_rms_norm(norm: nn.Module) -> bool:
    """Whether the norm computes x * rsqrt(mean(x^2) + eps) * weight, the grid's own RMSNorm (which needs one
    statistic per token, not the whole hidden dim): checked on a probe with a random weight, so that any class
    that computes it (torch's, Llama's, Qwen3's) is recognised by what it does, and any other (Gemma's
    (1 + weight), a LayerNorm's mean and bias) runs whole (norm_whole)."""
    params = dict(norm.named_parameters(recurse=False))
    if set(params) != {"weight"} or params["weight"].dim() != 1 or not hasattr(norm, "variance_epsilon") and \
            not isinstance(norm, nn.RMSNorm):
        return False
    gen = torch.Generator().manual_seed(0)
    width = params["weight"].numel()
    x, w = torch.randn(3, width, generator=gen), torch.rand(width, generator=gen) + 0.5
    eps = norm.eps if isinstance(norm, nn.RMSNorm) else float(norm.variance_epsilon)
    eps = torch.finfo(torch.float32).eps if eps is None else eps
    with torch.no_grad():
        got = functional_call(norm, {"weight": w}, (x,))
    return torch.allclose(got.float(), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w, atol=1e-6)


def gather_output(module: nn.Module, split: HiddenSplit) -> None:
    """The module's output whole along the hidden split (transformers' colwise_gather_output): forward
    all-gather, backward this rank's slice (every rank of the split computes the same from there on)."""
    module.register_forward_hook(lambda mod, args, out: comm.gather_last_dim(out, split.hidden_group))


def split_input(module: nn.Module, split: HiddenSplit) -> None:
    """The module's whole input cut to this rank's hidden chunk (transformers' rowwise_split_input): forward
    slice, backward all-gather (the gradient of the whole is every rank's slice)."""
    on_input(module, lambda x: comm.scatter_last_dim(x, split.hidden_group))


def block_whole(block: nn.Module, split: HiddenSplit) -> None:
    """A block every rank of the grid computes whole on the whole micro-batch (an MoE block, as 1D tensor
    parallelism computes it on every tp rank: its routing, capacity and router statistics those of the whole
    micro-batch): its input gathered over the hidden split and the batch chunks (backward: this rank's slice,
    every rank computing the same from there on), this rank's chunk of its output (backward: all-gathered).
    Its gradients are then the same on every rank and need no reduction."""
    def whole(x: torch.Tensor) -> torch.Tensor:
        x = comm.gather_seq_to_replica(x, -1, split.hidden_group)
        for group in split.batch_groups:  # inner first: the batch chunks in their order
            x = comm.gather_seq_to_replica(x, 0, group)
        return x

    def mine(out):
        y = out[0] if isinstance(out, tuple) else out  # a block that returns its router logits beside (Mixtral's)
        for group in reversed(split.batch_groups):  # outer first
            y = comm.scatter_seq(y, 0, group)
        y = comm.scatter_seq(y, -1, split.hidden_group)
        return (y, *out[1:]) if isinstance(out, tuple) else y

    on_input(block, whole)
    block.register_forward_hook(lambda mod, args, out: mine(out))
