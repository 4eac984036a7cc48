"""Megatron-style 1D tensor parallelism, sequence parallelism, vocab-parallel loss.

Layers (Shoeybi et al. 2019, section 3):

- ColumnParallelLinear: the weight's output features are split over the tp
  group; the input is replicated (it enters through f, or through the
  sequence-parallel all-gather g), the output stays sharded on its last dim.
- RowParallelLinear: the weight's input features are split; each rank makes a
  partial sum of the output, which leaves through g (all-reduce) or, under
  sequence parallelism, g-bar (reduce-scatter along the sequence).
- VocabParallelEmbedding: rows of the table are split; ids owned by another
  rank give zeros locally and the partial embeddings are summed like a row-
  parallel output.
- vocab_parallel_cross_entropy: the loss from vocab-sharded logits with one
  max all-reduce and one all-reduce of (target logit, sum of exp); the whole
  logits never exist on one rank.

A vocabulary that tp does not divide is padded to the next multiple; padded
rows are zero, never looked up, and their logits are masked out of the loss.

Every layer is built `from_xxx(plain_module, ctx)` where ctx (TPContext) holds
the group and the sequence-parallel switch. Colossal-AI's 2D/2.5D/3D layers fit
the same shape: their own context (a grid of groups) and `from_linear`
constructors, registered as further styles in STYLES so that plans and
`apply_plan` do not change.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tessel.mesh import Mesh
from tessel.parallel.tensor import comm
from tessel.sharding import logical_shape, mark_sharded, set_logical_shape, shard_dims


@dataclass(frozen=True)
class TPContext:
    """The tensor-parallel group as the layers see it. Activations are (B, T, C)."""
    group: object = None  # None when tp == 1
    size: int = 1
    rank: int = 0
    sequence_parallel: bool = False
    seq_dim: int = 1

    @classmethod
    def from_mesh(cls, mesh: Mesh, sequence_parallel: bool = False, axis: str = "tp") -> "TPContext":
        group = mesh.group(axis)
        rank = dist.get_rank(group) if group is not None else 0
        return cls(group, mesh.size(axis), rank, sequence_parallel and group is not None)

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


def _shard_rows(full: torch.Tensor, ctx: TPContext, padded_rows: int) -> torch.Tensor:
    """This rank's block of dim-0 rows of `full`, zero-padded to padded_rows first."""
    if padded_rows > full.size(0):
        full = torch.cat([full, full.new_zeros(padded_rows - full.size(0), *full.shape[1:])])
    return full.chunk(ctx.size, dim=0)[ctx.rank].detach().clone()


def _sharded_param(data: torch.Tensor, dim: int, logical_shape: torch.Size | None = None) -> nn.Parameter:
    p = nn.Parameter(data)
    mark_sharded(p, "tp", dim=dim)
    if logical_shape is not None:
        set_logical_shape(p, logical_shape)
    return p


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split over the tp group.

    enter: apply ctx.enter to the input (set False when an enclosing module
    already did, so that q, k, v share one all-gather / one gradient all-reduce).
    gather_output: return the whole output (padding removed) instead of the shard.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext,
                 out_features: int, enter: bool = True, gather_output: bool = False):
        super().__init__()
        self.weight, self.bias, self.ctx = weight, bias, ctx
        self.in_features, self.out_features = weight.size(1), out_features
        self.enter, self.gather_output = enter, gather_output

    @classmethod
    def from_linear(cls, linear: nn.Linear, ctx: TPContext, shared_weight: nn.Parameter | None = None,
                    **kw) -> "ColumnParallelLinear":
        out = linear.out_features
        rows = ctx.padded(out)
        logical = linear.weight.shape if rows != out else None
        weight = shared_weight if shared_weight is not None else \
            _sharded_param(_shard_rows(linear.weight, ctx, rows), 0, logical)
        bias = None
        if linear.bias is not None:
            bias = _sharded_param(_shard_rows(linear.bias, ctx, rows), 0, linear.bias.shape if logical else None)
        return cls(weight, bias, ctx, out, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enter:
            x = self.ctx.enter(x)
        y = F.linear(x, self.weight, self.bias)  # (.., out / tp)
        if self.gather_output:
            y = comm.gather_last_dim(y, self.ctx.group)[..., : self.out_features]
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_out={self.weight.size(0)}, tp={self.ctx.size}"


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split; partial outputs summed by ctx.exit.

    input_is_parallel: x already holds this rank's slice of the features (the
    output of a column-parallel layer); otherwise it is scattered here.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext,
                 input_is_parallel: bool = True):
        super().__init__()
        self.weight, self.bias, self.ctx = weight, bias, ctx
        self.in_features, self.out_features = weight.size(1) * ctx.size, weight.size(0)
        self.input_is_parallel = input_is_parallel

    @classmethod
    def from_linear(cls, linear: nn.Linear, ctx: TPContext, **kw) -> "RowParallelLinear":
        if linear.in_features % ctx.size:
            raise ValueError(f"in_features {linear.in_features} is not divisible by tp {ctx.size}")
        weight = _sharded_param(linear.weight.chunk(ctx.size, dim=1)[ctx.rank].detach().clone(), 1)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # replicated
        return cls(weight, bias, ctx, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_last_dim(x, self.ctx.group)
        y = self.ctx.exit(F.linear(x, self.weight))  # partial sums -> whole (or sequence shard)
        if self.bias is not None:
            # under sequence parallelism each rank adds the bias to its own tokens only
            bias = comm.copy_to_tp(self.bias, self.ctx.group) if self.ctx.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, local_in={self.weight.size(1)}, tp={self.ctx.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary ids) over the tp group."""

    def __init__(self, weight: nn.Parameter, ctx: TPContext, num_embeddings: int):
        super().__init__()
        self.weight, self.ctx, self.num_embeddings = weight, ctx, num_embeddings
        self.vocab_start = ctx.rank * weight.size(0)
        self.vocab_end = self.vocab_start + weight.size(0)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, ctx: TPContext) -> "VocabParallelEmbedding":
        rows = ctx.padded(emb.num_embeddings)
        logical = emb.weight.shape if rows != emb.num_embeddings else None
        return cls(_sharded_param(_shard_rows(emb.weight, ctx, rows), 0, logical), ctx, emb.num_embeddings)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        foreign = (idx < self.vocab_start) | (idx >= self.vocab_end)  # ids another rank owns
        local = (idx - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight).masked_fill(foreign.unsqueeze(-1), 0.0)  # (B, T, C) partial
        return self.ctx.exit(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.size(1)}, rows {self.vocab_start}:{self.vocab_end}"


class SequenceParallelNorm(nn.Module):
    """RMSNorm / LayerNorm on sequence-sharded activations.

    Each rank normalizes its own tokens, so the gradient of the (replicated)
    weight is a partial sum over 1/tp of the tokens: the weight passes through
    f (CopyToTP), whose backward all-reduces it over tp before it accumulates.
    After that the gradient is whole and identical on every rank, so the
    global norm counts it once (the parameter stays unmarked: replicated).
    """

    def __init__(self, norm: nn.RMSNorm | nn.LayerNorm, ctx: TPContext):
        super().__init__()
        self.kind = "rms" if isinstance(norm, nn.RMSNorm) else "layer"
        self.normalized_shape, self.eps, self.ctx = tuple(norm.normalized_shape), norm.eps, ctx
        self.weight = norm.weight  # the same Parameter objects: state_dict names are unchanged
        self.bias = getattr(norm, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = comm.copy_to_tp(self.weight, self.ctx.group) if self.weight is not None else None
        if self.kind == "rms":
            return F.rms_norm(x, self.normalized_shape, w, self.eps)
        b = comm.copy_to_tp(self.bias, self.ctx.group) if self.bias is not None else None
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from vocab-sharded logits (Megatron's
    _VocabParallelCrossEntropy, Shoeybi et al. 2019 section 3).

    Per token: m = max over the whole vocabulary (all-reduce MAX), then the
    target's logit and sum(exp(logit - m)) (one all-reduce SUM of both):
    loss = log(sum_exp) - (target_logit - m). Backward is local:
    softmax - onehot(target), restricted to this rank's columns.
    """

    @staticmethod
    def forward(ctx, logits, targets, vocab_start, vocab_size, group):
        x = logits.float()  # (N, Vl)
        n_local = x.size(-1)
        real = vocab_size - vocab_start  # columns of this shard that are real vocabulary
        if real < n_local:
            x = x.clone()
            x[:, max(real, 0):] = float("-inf")  # padding: exp() = 0, never the max, never a target
        m = x.max(dim=-1).values
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        x = x - m.unsqueeze(-1)
        foreign = (targets < vocab_start) | (targets >= vocab_start + n_local)
        local_t = (targets - vocab_start).masked_fill(foreign, 0)
        target_logit = x.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(foreign, 0.0)
        exp = x.exp_()  # x is a fresh tensor here: reuse it for the softmax
        both = torch.stack([target_logit, exp.sum(dim=-1)])  # (2, N): one all-reduce for both
        if group is not None:
            dist.all_reduce(both, group=group)
        target_logit, sum_exp = both
        loss = (sum_exp.log() - target_logit).mean()
        exp.div_(sum_exp.unsqueeze(-1))  # softmax over the whole vocabulary, local columns
        ctx.save_for_backward(exp, local_t, foreign)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, local_t, foreign = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.size(0), device=g.device)
        g[rows, local_t] -= (~foreign).float()
        g.mul_(grad / g.size(0))
        return g.to(ctx.in_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ctx: TPContext,
                                 vocab_size: int) -> torch.Tensor:
    """Mean next-token loss; logits (B, T, V_padded / tp) on each rank, targets (B, T) global ids."""
    start = ctx.rank * logits.size(-1)
    return VocabParallelCrossEntropy.apply(logits.flatten(0, -2), targets.flatten(), start, vocab_size, ctx.group)


# ---- plans: module name pattern -> style ---------------------------------------

def _enter_region(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    # one f (or all-gather) for every column-parallel layer inside: q, k, v share it
    module.register_forward_pre_hook(lambda mod, args: (ctx.enter(args[0]), *args[1:]))
    return module


def _vocab_embedding(module: nn.Embedding, ctx: TPContext, memo: dict) -> nn.Module:
    new = VocabParallelEmbedding.from_embedding(module, ctx)
    memo[id(module.weight)] = new.weight
    return new


def _vocab_head(module: nn.Linear, ctx: TPContext, memo: dict) -> nn.Module:
    shared = memo.get(id(module.weight))  # tied embeddings: the same rows, the same shard
    new = ColumnParallelLinear.from_linear(module, ctx, shared_weight=shared, enter=True)
    memo[id(module.weight)] = new.weight
    return new


def _colwise(module: nn.Linear, ctx: TPContext, memo: dict) -> nn.Module:
    return ColumnParallelLinear.from_linear(module, ctx, enter=False)


def _rowwise(module: nn.Linear, ctx: TPContext, memo: dict) -> nn.Module:
    return RowParallelLinear.from_linear(module, ctx)


def _sequence_norm(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    return SequenceParallelNorm(module, ctx) if ctx.sequence_parallel else module


def _replicate(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    """Computed whole on every tp rank: input, output and parameter gradients are replicated,
    so the gradients need no tp reduction (MoE blocks: experts split over ep, not tp).

    Under sequence parallelism the input arrives sequence-sharded: it is all-gathered
    (backward: this rank's slice of the already whole gradient) and the output split
    again (backward: all-gather). Every rank then routes the same tokens as without
    SP, so MoE capacity and aux losses stay those of the whole micro-batch.
    """
    if ctx.sequence_parallel:
        module.register_forward_pre_hook(
            lambda mod, args: (comm.gather_seq_to_replica(args[0], ctx.seq_dim, ctx.group), *args[1:]))
        module.register_forward_hook(lambda mod, args, out: comm.scatter_seq(out, ctx.seq_dim, ctx.group))
    return module


STYLES: dict[str, Callable[[nn.Module, TPContext, dict], nn.Module]] = {
    "enter": _enter_region, "colwise": _colwise, "rowwise": _rowwise,
    "vocab_embedding": _vocab_embedding, "vocab_head": _vocab_head, "sequence_norm": _sequence_norm,
    "replicate": _replicate,
}


def match_plan(model: nn.Module, plan: dict[str, str]) -> dict[str, str]:
    """{module name: style} for every module some pattern names (the first matching pattern wins)."""
    found, used = {}, set()
    for name, _ in model.named_modules():
        for pattern, style in plan.items():
            if fnmatch.fnmatchcase(name, pattern):
                if style not in STYLES:
                    raise ValueError(f"plan entry {pattern!r}: unknown style {style!r}; known: {sorted(STYLES)}")
                found[name] = style
                used.add(pattern)
                break
    unused = [p for p in plan if p not in used]
    if unused:
        raise ValueError(f"plan patterns match no module: {unused}")
    for name, style in found.items():
        # a column-parallel layer that does not enter a region itself needs an enclosing one
        if style == "colwise" and not any(found.get(a) == "enter" for a in _ancestors(name)):
            raise ValueError(f"{name} is 'colwise' but no enclosing module has style 'enter'")
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def apply_plan(model: nn.Module, plan: dict[str, str], ctx: TPContext) -> nn.Module:
    """Swap the modules a plan names for their tensor-parallel versions, in place."""
    memo: dict = {}
    for name, style in match_plan(model, plan).items():  # parents before children
        module = model.get_submodule(name)
        new = STYLES[style](module, ctx, memo)
        if new is not module:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    return model


# ---- helpers for checks and checkpoints --------------------------------------------

def full_tensor(t: torch.Tensor, param: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """The whole logical tensor of `t` (a parameter or its gradient) from its tp shards; a copy."""
    dim = shard_dims(param).get("tp")
    if dim is None or ctx.group is None:
        return t.detach().clone()
    full = comm.all_gather_dim(t.detach(), dim, ctx.group)
    logical = logical_shape(param)
    if logical is not None:
        full = full.narrow(dim, 0, logical[dim])  # drop vocabulary padding
    return full


def local_param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(module.parameters()))


class VocabParallelLoss:
    """loss_fn(logits_shard, targets) for a model whose head is vocab-parallel."""

    def __init__(self, ctx: TPContext, vocab_size: int):
        self.ctx, self.vocab_size = ctx, vocab_size

    def __call__(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, targets, self.ctx, self.vocab_size)


class GatherVocab:
    """Vocab-sharded logits (..., V/tp) -> (..., V_padded) on every tp rank (a pipeline's last stage
    samples from them); collective over tp."""

    def __init__(self, ctx: TPContext):
        self.ctx = ctx

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return comm.gather_last_dim(logits, self.ctx.group)


class FullLogits:
    """model(idx) -> logits over the whole vocabulary, padding removed (for sampling).

    Under sequence parallelism the length must split over tp; a prompt of any
    length is padded on the right (causal attention: later tokens cannot change
    earlier logits), or trimmed on the left when padding would pass max_seq_len.
    """

    def __init__(self, model: nn.Module, ctx: TPContext, vocab_size: int, max_seq_len: int):
        self.model, self.ctx, self.vocab_size, self.max_seq_len = model, ctx, vocab_size, max_seq_len

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        T, n = idx.size(1), self.ctx.size
        if self.ctx.sequence_parallel and T % n:
            if T + (n - T % n) <= self.max_seq_len:
                idx = F.pad(idx, (0, n - T % n))
            else:
                idx, T = idx[:, T % n:], T - T % n
        logits = comm.gather_last_dim(self.model(idx), self.ctx.group)  # (B, T', V_padded)
        return logits[:, :T, : self.vocab_size]
