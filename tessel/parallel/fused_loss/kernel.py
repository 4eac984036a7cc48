"""The output head's matmul and the cross-entropy in one pass over chunks of tokens: the whole logits never exist.

Follows Liger-Kernel's fused linear cross-entropy (Hsu et al. 2024, "Liger Kernel: Efficient Triton Kernels
for LLM Training", sec. 3.3; its `fused_linear_cross_entropy_forward`), in plain torch: for each chunk of
tokens, the chunk's logits (the matmul in the autocast dtype, as the head computes them), their fp32
statistics (max, log-sum-exp, the target's logit), the loss, and at once the gradients, since the chunk's
softmax minus one-hot is all they need: the hidden states' gradient (d @ W) and the weight's (d^T @ x),
accumulated in fp32. The forward keeps these two gradients for backward, which only scales them by the
incoming gradient (the weight's in place): no second logits matmul, no logits saved. Under no_grad only the
loss is computed.

Vocabulary-parallel (Megatron's vocab-parallel cross-entropy, Shoeybi et al. 2019 sec. 3, as
tessel.parallel.tensor.tensor_parallel.VocabParallelCrossEntropy): each rank holds a block of the head's
rows; per chunk one MAX all-reduce of the row maxima and one SUM all-reduce of (target logit, sum of exp)
give every rank the whole vocabulary's statistics; its gradients are its own columns' (the hidden states'
gradient is a partial sum that the head's tp entry sums on its way back). Rows past the real vocabulary
(padding to a multiple of tp) are masked out: never the max, exp() = 0, never a target, zero gradient.

Gemma 2's final soft-capping, cap * tanh(logits / cap), can be applied to each chunk's logits before the
statistics (its derivative, 1 - tanh^2, joins the chunk's gradient).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessel.parallel.fused_loss.chunks import MAX_CHUNKS, chunk_tokens  # noqa: F401 (MAX_CHUNKS: the rule's bound)


@dataclass(frozen=True)
class Vocab:
    """Which rows of the vocabulary this rank's head holds, and how the loss treats the logits."""
    start: int = 0  # the first row's id (rank * rows under vocab-parallel tp)
    size: int | None = None  # the real vocabulary; rows at ids >= size are padding (None: every row is real)
    group: object = None  # the tp group the vocabulary is split over (None: whole here)
    softcap: float | None = None  # cap * tanh(logits / cap) before the loss (Gemma 2)
    chunk: int | None = None  # tokens per chunk (None: chunk_tokens' choice)
    ignore_index: int = -100  # a target that takes no part, as F.cross_entropy's


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         targets: torch.Tensor, vocab: Vocab = Vocab()) -> torch.Tensor:
    """Mean cross-entropy of F.linear(hidden, weight, bias) against targets, over the tokens whose target is
    not vocab.ignore_index (F.cross_entropy's mean), without the logits: hidden (..., C), weight (rows, C)
    this rank's rows, targets (...) global ids. Under autocast the matmuls run in its dtype, as the head's."""
    hidden, targets = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    inputs = (hidden, weight, bias)
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in inputs):
        with torch.autocast(device, enabled=False):
            return _chunks(hidden, weight, bias, targets, vocab, dtype, (False, False, False))[0]
    return LinearCrossEntropy.apply(hidden, weight, bias, targets, vocab, dtype)


class LinearCrossEntropy(torch.autograd.Function):
    """loss = mean cross-entropy of hidden @ weight^T + bias; the gradients are made in forward (module doc)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, vocab: Vocab, dtype: torch.dtype):
        want = tuple(ctx.needs_input_grad[:3])
        with torch.autocast(hidden.device.type, enabled=False):  # the dtypes are chosen here, explicitly
            loss, grads = _chunks(hidden, weight, bias, targets, vocab, dtype, want)
        ctx.save_for_backward(*grads)
        ctx.applied = None  # the incoming gradient the saved weight gradients were scaled by
        return loss

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        d_hidden, d_weight, d_bias = ctx.saved_tensors
        # the hidden states' gradient out of place: a tp entry's backward all-reduces it in place
        d_hidden = None if d_hidden is None else d_hidden * grad
        if ctx.applied is None:
            # the weight's (and bias's) scaled in place, so backward adds no second weight-sized buffer; through
            # .data, whose version the saved tensors do not see, so that a second call can still unpack them
            for g in (d_weight, d_bias):
                if g is not None:
                    g.data.mul_(grad)
            ctx.applied = grad
        else:
            # a second call (a zero-bubble pipeline's W after its B, tessel.parallel.pipeline.split_backward, or
            # a retained graph): the saved ones hold the first call's scale; this one's, without a host read
            d_weight, d_bias = (None if g is None else g * (grad / ctx.applied) for g in (d_weight, d_bias))
        return d_hidden, d_weight, d_bias, None, None, None


def _chunks(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
            vocab: Vocab, dtype: torch.dtype, want: tuple[bool, bool, bool]):
    """(mean loss, (d hidden, d weight, d bias) or None where not wanted), chunk by chunk."""
    tokens, rows = hidden.size(0), weight.size(0)
    w = weight.to(dtype)  # the head's matmul dtype (autocast's cast, once for every chunk)
    b = bias.to(dtype) if bias is not None else None
    real = rows if vocab.size is None else min(max(vocab.size - vocab.start, 0), rows)  # rows past it: padding
    valid = targets != vocab.ignore_index
    count = valid.sum()  # a tensor: no host synchronization
    local = targets - vocab.start
    own = valid & (local >= 0) & (local < real)  # targets in this rank's rows
    local = local.masked_fill(~own, 0)
    share = valid / count  # each token's weight in the mean
    total = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grads = _Grads(torch.empty_like(hidden) if want[0] else None,
                   torch.zeros(rows, weight.size(1), dtype=torch.float32, device=weight.device) if want[1] else None,
                   torch.zeros(rows, dtype=torch.float32, device=weight.device) if want[2] and b is not None else None)
    n = vocab.chunk or chunk_tokens(tokens, hidden.size(1), rows)
    buf = _Buffers.make(min(n, tokens), weight, dtype, want[1])
    for s in range(0, tokens, n):
        e = min(s + n, tokens)
        x = hidden[s:e].to(dtype)
        z = buf.logits_of(x, w, b)  # (n, rows): the chunk's fp32 logits, the only ones that exist
        slope = _softcap_(z, vocab.softcap, any(want))
        if real < rows:
            z[:, real:] = float("-inf")  # padding: never the max, exp() = 0, no gradient
        loss_rows, sum_exp = _statistics_(z, local[s:e], own[s:e], vocab.group)
        total += loss_rows.masked_fill(~valid[s:e], 0.0).sum()
        if any(want):
            # the softmax, minus one-hot at this rank's targets, times each token's share of the mean
            z.div_(sum_exp.unsqueeze(-1))
            z.scatter_add_(1, local[s:e, None], -own[s:e, None].to(z.dtype))
            z.mul_(share[s:e, None])
            if slope is not None:
                z.mul_(slope)
            grads.add(z, x, w, slice(s, e), buf)
    return total / count, (grads.hidden, _as(grads.weight, weight), _as(grads.bias, bias))


@dataclass
class _Buffers:
    """What every chunk reuses, allocated once: otherwise a chunk's (n, rows) temporaries are allocated and
    freed as many times as there are chunks (on the CPU, glibc's heap then keeps them: measured +40% resident
    memory at GPT-2's vocabulary), and the caching allocator of a GPU hands out the same blocks anyway."""
    logits: torch.Tensor  # (n, rows) fp32
    low: torch.Tensor | None  # (n, rows) in the matmul dtype where it is not fp32: the product, then the gradient
    product: torch.Tensor | None  # (rows, C) in that dtype: a chunk's weight gradient before the fp32 sum

    @classmethod
    def make(cls, n: int, weight: torch.Tensor, dtype: torch.dtype, weight_grad: bool) -> "_Buffers":
        rows, low = weight.size(0), dtype != torch.float32
        return cls(torch.empty(n, rows, dtype=torch.float32, device=weight.device),
                   torch.empty(n, rows, dtype=dtype, device=weight.device) if low else None,
                   torch.empty_like(weight, dtype=dtype) if low and weight_grad else None)

    def logits_of(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
        """The chunk's logits in fp32: the matmul (and bias) in w's dtype, as the head computes them."""
        z = self.logits[:x.size(0)]
        out = z if self.low is None else self.low[:x.size(0)]
        if b is None:
            torch.mm(x, w.t(), out=out)
        else:
            torch.addmm(b, x, w.t(), out=out)
        return z if self.low is None else z.copy_(out)


@dataclass
class _Grads:
    hidden: torch.Tensor | None  # (tokens, C) in the hidden states' dtype
    weight: torch.Tensor | None  # (rows, C) fp32, summed over the chunks
    bias: torch.Tensor | None  # (rows,) fp32

    def add(self, d32: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rows: slice, buf: _Buffers) -> None:
        """A chunk's share, from d32 = d loss / d logits (fp32): its matmuls in the head's dtype, as the head's
        own backward runs them on the logits' gradient."""
        d = d32 if buf.low is None else buf.low[:d32.size(0)].copy_(d32)
        if self.hidden is not None:
            self.hidden[rows] = d @ w  # under tp a partial sum over the vocabulary: the head's entry adds them up
        if self.weight is not None:
            if buf.product is None:
                self.weight.addmm_(d.t(), x)  # fp32: in place
            else:
                self.weight.add_(torch.mm(d.t(), x, out=buf.product))
        if self.bias is not None:
            self.bias.add_(d32.sum(0))


def _softcap_(z: torch.Tensor, cap: float | None, slope: bool) -> torch.Tensor | None:
    """z <- cap * tanh(z / cap) in place; returns d(capped)/d(z) = 1 - tanh^2 when gradients follow."""
    if cap is None:
        return None
    t = z.div_(cap).tanh_()
    out = 1.0 - t * t if slope else None
    t.mul_(cap)
    return out


def _statistics_(z: torch.Tensor, local: torch.Tensor, own: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: log-sum-exp minus the target's logit over the whole vocabulary (two all-reduces under tp), and
    the sum of exp(z - max); z becomes exp(z - max) in place (this rank's columns)."""
    m = z.amax(dim=-1)
    if group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
    z.sub_(m.unsqueeze(-1))
    target = z.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill(~own, 0.0)
    z.exp_()
    both = torch.stack([target, z.sum(dim=-1)])  # (2, n): one all-reduce for both
    if group is not None:
        dist.all_reduce(both, group=group)
    target, sum_exp = both
    return sum_exp.log() - target, sum_exp


def _as(grad: torch.Tensor | None, param: torch.Tensor | None) -> torch.Tensor | None:
    """A gradient accumulated in fp32, in its parameter's dtype (bf16 under ZeRO's bf16 storage)."""
    return None if grad is None else grad.to(param.dtype)
