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

The layers keep the weight layout of the module they replace: nn.Linear's
[out, in], or [in, out] for transformers' Conv1D (GPT-2's linear layers), so
parameter names and logical shapes stay the model's own. A fused q|k|v
projection (GPT-2's c_attn, Phi-3's qkv_proj, whose k and v blocks are smaller
than q's under grouped-query attention) is split block by block: each rank
holds the q, k and v columns of its own heads (tessel.sharding.mark_packed;
checkpoints save it as pieces of the logical tensor:
tessel.train.checkpoint.packed).

Every layer is built `from_xxx(plain_module, ctx)` where ctx (TPContext) holds
the group and the sequence-parallel switch. Colossal-AI's 2D/2.5D/3D layers fit
the same shape: their own context (a grid of groups) and `from_linear`
constructors, registered as further styles in STYLES so that plans and
`apply_plan` do not change.
"""

from __future__ import annotations

import copy
import fnmatch
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tessel.parallel.tensor import comm, overlap, regions
from tessel.parallel.tensor.context import TPContext
from tessel.sharding import (block_sizes, logical_shape, mark_packed, mark_sharded, packed_dims, set_logical_shape,
                             shard_dims)


def _shard(full: torch.Tensor, dim: int, ctx: TPContext, padded: int) -> torch.Tensor:
    """This rank's block of `full` along `dim`, zero-padded to `padded` entries first."""
    if padded > full.size(dim):
        pad = list(full.shape)
        pad[dim] = padded - full.size(dim)
        full = torch.cat([full, full.new_zeros(pad)], dim=dim)
    return full.chunk(ctx.size, dim=dim)[ctx.rank].detach().clone()


def _sharded_param(data: torch.Tensor, dim: int, logical_shape: torch.Size | None = None) -> nn.Parameter:
    p = nn.Parameter(data)
    mark_sharded(p, "tp", dim=dim)
    if logical_shape is not None:
        set_logical_shape(p, logical_shape)
    return p


def _packed_param(full: torch.Tensor, dim: int, blocks: tuple[int, ...], ctx: TPContext) -> nn.Parameter:
    """This rank's chunk of each packed block of `full` along dim (relative sizes `blocks`), side by side."""
    sizes = block_sizes(blocks, full.size(dim))
    if any(size % ctx.size for size in sizes):
        raise ValueError(f"packed blocks of sizes {sizes} do not split over tp {ctx.size}")
    pieces = [block.chunk(ctx.size, dim=dim)[ctx.rank] for block in full.split(sizes, dim)]
    p = nn.Parameter(torch.cat(pieces, dim).detach().clone())
    mark_packed(p, "tp", dim, blocks)
    return p


def _in_out(module: nn.Module) -> bool:
    """True when the module stores its weight [in, out] (transformers' Conv1D, GPT-2's linear
    layers: y = x W + b), False for nn.Linear's [out, in]."""
    if isinstance(module, nn.Linear):
        return False
    # deferred: transformers takes seconds to import; only a module that is not an nn.Linear gets here
    from transformers.pytorch_utils import Conv1D
    if isinstance(module, Conv1D):
        return True
    raise TypeError(f"a {type(module).__name__} is neither an nn.Linear nor transformers' Conv1D")


class ColumnParallelLinear(nn.Module):
    """y = x W^T with W's rows (output features) split over the tp group.

    enter: apply ctx.enter to the input (set False when an enclosing module
    already did, so that q, k, v share one all-gather / one gradient all-reduce).
    gather_output: return the whole output (padding removed) instead of the shard.
    in_out: the weight is stored [in, out] (transformers' Conv1D), sharded on dim 1.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext,
                 out_features: int, enter: bool = True, gather_output: bool = False, in_out: bool = False):
        super().__init__()
        self.weight, self.bias, self.ctx, self.in_out = weight, bias, ctx, in_out
        self.in_features, self.out_features = weight.size(0 if in_out else 1), out_features
        self.enter, self.gather_output = enter, gather_output
        self.pending = None  # (gathered input, output) an OverlappedRegion made for this layer (tp_overlap)
        self.matmul = F.linear  # (x, weight, bias); train.precision = "fp8" swaps in tessel.parallel.float8's

    @classmethod
    def from_linear(cls, linear: nn.Module, ctx: TPContext, shared_weight: nn.Parameter | None = None,
                    blocks: tuple[int, ...] = (1,), **kw) -> "ColumnParallelLinear":
        """From an nn.Linear or a Conv1D. Several blocks: the output packs blocks of these relative sizes
        (q|k|v, gate|up), each split over tp, so that every rank holds the q, k and v of its own heads."""
        in_out = _in_out(linear)
        dim = 1 if in_out else 0  # the output features' dim of the weight
        out = linear.weight.size(dim)
        if len(blocks) > 1:
            if kw.get("gather_output"):
                raise ValueError("a packed projection's output cannot be gathered whole")
            weight = _packed_param(linear.weight, dim, blocks, ctx)
            bias = None if linear.bias is None else _packed_param(linear.bias, 0, blocks, ctx)
            return cls(weight, bias, ctx, out, in_out=in_out, **kw)
        padded = ctx.padded(out)
        logical = linear.weight.shape if padded != out else None
        weight = shared_weight if shared_weight is not None else \
            _sharded_param(_shard(linear.weight, dim, ctx, padded), dim, logical)
        bias = None
        if linear.bias is not None:
            bias = _sharded_param(_shard(linear.bias, 0, ctx, padded), 0, linear.bias.shape if logical else None)
        return cls(weight, bias, ctx, out, in_out=in_out, **kw)

    def matmul_weight(self) -> torch.Tensor:
        """The weight as F.linear takes it, [out / tp, in]."""
        return self.weight.t() if self.in_out else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x)  # (.., out / tp)
        if self.gather_output:
            y = comm.gather_last_dim(y, self.ctx.group)[..., : self.out_features]
        return y

    def _linear(self, x: torch.Tensor) -> torch.Tensor:
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] is x:  # made by the region's overlapped gather
            return pending[1]
        if self.enter and self.ctx.overlap:
            return overlap.gather_linear(x, [self.matmul_weight()], [self.bias], self.ctx.seq_dim, self.ctx.group)[1]
        if self.enter:
            x = self.ctx.enter(x)
        return self.matmul(x, self.matmul_weight(), self.bias)

    def extra_repr(self) -> str:
        local = self.weight.size(1 if self.in_out else 0)
        return f"in={self.in_features}, out={self.out_features}, local_out={local}, tp={self.ctx.size}"


class RowParallelLinear(nn.Module):
    """y = x W^T with W's columns (input features) split; partial outputs summed by ctx.exit.

    input_is_parallel: x already holds this rank's slice of the features (the
    output of a column-parallel layer); otherwise it is scattered here.
    in_out: the weight is stored [in, out] (transformers' Conv1D), sharded on dim 0.
    """

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, ctx: TPContext,
                 input_is_parallel: bool = True, in_out: bool = False):
        super().__init__()
        self.weight, self.bias, self.ctx, self.in_out = weight, bias, ctx, in_out
        local_in, out = (weight.size(0), weight.size(1)) if in_out else (weight.size(1), weight.size(0))
        self.in_features, self.out_features = local_in * ctx.size, out
        self.input_is_parallel = input_is_parallel
        self.matmul = F.linear  # (x, weight, bias); train.precision = "fp8" swaps in tessel.parallel.float8's

    @classmethod
    def from_linear(cls, linear: nn.Module, ctx: TPContext, **kw) -> "RowParallelLinear":
        """From an nn.Linear or a Conv1D."""
        in_out = _in_out(linear)
        dim = 0 if in_out else 1  # the input features' dim of the weight
        if linear.weight.size(dim) % ctx.size:
            raise ValueError(f"in_features {linear.weight.size(dim)} is not divisible by tp {ctx.size}")
        weight = _sharded_param(linear.weight.chunk(ctx.size, dim=dim)[ctx.rank].detach().clone(), dim)
        bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone())  # replicated
        return cls(weight, bias, ctx, in_out=in_out, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = comm.scatter_last_dim(x, self.ctx.group)
        w = self.weight.t() if self.in_out else self.weight
        if self.ctx.overlap:  # the partial sums reduce-scattered round the ring as they are made
            y = overlap.linear_reduce_scatter(x, w, self.ctx.seq_dim, self.ctx.group)
        else:
            y = self.ctx.exit(self.matmul(x, w))  # partial sums -> whole (or sequence shard)
        if self.bias is not None:
            # under sequence parallelism each rank adds the bias to its own tokens only
            bias = comm.copy_to_tp(self.bias, self.ctx.group) if self.ctx.sequence_parallel else self.bias
            y = y + bias
        return y

    def extra_repr(self) -> str:
        local = self.weight.size(0 if self.in_out else 1)
        return f"in={self.in_features}, out={self.out_features}, local_in={local}, tp={self.ctx.size}"


class VocabParallelEmbedding(nn.Module):
    """Embedding table split by rows (vocabulary ids) over the tp group.

    whole_output: the partial embeddings are all-reduced (g) even under sequence parallelism, for a
    model that reads positions and its causal mask from the embedding's output (Hugging Face's);
    the sequence is then split at the first decoder layer (style "split_sequence"). Otherwise they
    leave through ctx.exit (reduce-scattered along the sequence under sequence parallelism).
    padding_idx: as nn.Embedding's, a row that gets no gradient.
    embed_scale: a factor on every row (transformers' scaled word embeddings, Gemma's sqrt(hidden)), the
    module's own buffer kept under its name; the owner's row times it, plus zeros, is its product exactly.
    """

    def __init__(self, weight: nn.Parameter, ctx: TPContext, num_embeddings: int, whole_output: bool = False,
                 padding_idx: int | None = None, embed_scale: torch.Tensor | None = None):
        super().__init__()
        self.weight, self.ctx, self.num_embeddings = weight, ctx, num_embeddings
        self.whole_output = whole_output
        self.vocab_start = ctx.rank * weight.size(0)
        self.vocab_end = self.vocab_start + weight.size(0)
        own = padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
        self.local_padding_idx = padding_idx - self.vocab_start if own else None
        self.register_buffer("embed_scale", embed_scale, persistent=False)

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, ctx: TPContext, whole_output: bool = False) -> "VocabParallelEmbedding":
        rows = ctx.padded(emb.num_embeddings)
        logical = emb.weight.shape if rows != emb.num_embeddings else None
        return cls(_sharded_param(_shard(emb.weight, 0, ctx, rows), 0, logical), ctx, emb.num_embeddings,
                   whole_output, emb.padding_idx, _embed_scale(emb))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        foreign = (idx < self.vocab_start) | (idx >= self.vocab_end)  # ids another rank owns
        local = (idx - self.vocab_start).masked_fill(foreign, 0)
        out = F.embedding(local, self.weight, self.local_padding_idx)
        if self.embed_scale is not None:
            out = out * self.embed_scale.to(self.weight.dtype)  # as transformers' ScaledWordEmbedding.forward
        out = out.masked_fill(foreign.unsqueeze(-1), 0.0)  # (B, T, C) partial
        return comm.reduce_from_tp(out, self.ctx.group) if self.whole_output else self.ctx.exit(out)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.weight.size(1)}, rows {self.vocab_start}:{self.vocab_end}"


def _embed_scale(emb: nn.Embedding) -> torch.Tensor | None:
    """The factor a token embedding multiplies its rows by: None for nn.Embedding itself, the `embed_scale`
    buffer of transformers' scaled word embeddings (Gemma's: lookup * embed_scale); any other forward is
    refused, since the split table would skip it."""
    if type(emb).forward is nn.Embedding.forward:
        return None
    scale = getattr(emb, "embed_scale", None)
    if not isinstance(scale, torch.Tensor) or not type(emb).__name__.endswith("ScaledWordEmbedding"):
        raise TypeError(f"a {type(emb).__name__} computes its own forward, which a vocabulary-parallel table "
                        "would skip (tessel splits nn.Embedding and transformers' scaled word embeddings)")
    return scale.detach().clone()


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
    if ctx.overlap:  # the gather overlapped with the region's column layers
        region = overlap.OverlappedRegion(partial(_region_layers, module), ctx.seq_dim, ctx.group)
        regions.on_input(module, region)
    else:
        regions.enter_region(module, ctx)  # its input by position or by name (HF calls attention by keyword)
    return module


def _region_layers(module: nn.Module) -> list[ColumnParallelLinear]:
    """The column-parallel layers a region's entry feeds (those that do not enter one themselves)."""
    return [m for m in module.modules() if isinstance(m, ColumnParallelLinear) and not m.enter]


def _vocab_embedding(module: nn.Embedding, ctx: TPContext, memo: dict, whole_output: bool = False) -> nn.Module:
    new = VocabParallelEmbedding.from_embedding(module, ctx, whole_output)
    memo[id(module.weight)] = new.weight
    return new


def _vocab_embedding_whole(module: nn.Embedding, ctx: TPContext, memo: dict) -> nn.Module:
    return _vocab_embedding(module, ctx, memo, whole_output=True)


def _vocab_head(module: nn.Linear, ctx: TPContext, memo: dict, enter: bool = True) -> nn.Module:
    shared = memo.get(id(module.weight))  # tied embeddings: the same rows, the same shard
    new = ColumnParallelLinear.from_linear(module, ctx, shared_weight=shared, enter=enter)
    memo[id(module.weight)] = new.weight
    return new


def _vocab_head_entered(module: nn.Linear, ctx: TPContext, memo: dict) -> nn.Module:
    return _vocab_head(module, ctx, memo, enter=False)  # a "final_norm" before it entered the region


def _colwise(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    return ColumnParallelLinear.from_linear(module, ctx, enter=False)


def _colwise_qkv(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    return ColumnParallelLinear.from_linear(module, ctx, blocks=(1, 1, 1), enter=False)


def _colwise_packed(module: nn.Module, ctx: TPContext, memo: dict, blocks: tuple[int, ...]) -> nn.Module:
    return ColumnParallelLinear.from_linear(module, ctx, blocks=blocks, enter=False)


def _colwise_gather(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    # transformers' colwise_gather_output: what follows inside the region sees the whole output
    return ColumnParallelLinear.from_linear(module, ctx, enter=False, gather_output=True)


def _rowwise(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    return RowParallelLinear.from_linear(module, ctx)


def _rowwise_split(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    # transformers' rowwise_split_input: takes the whole input (after a colwise_gather) and keeps its own slice
    return RowParallelLinear.from_linear(module, ctx, input_is_parallel=False)


def _sum_grads(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    regions.sum_partial_grads(module, ctx)  # transformers' replicated_with_grad_allreduce
    return module


def _sequence_norm(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    regions.sum_grads_over_tp(module, ctx)  # under sequence parallelism only
    return module


def _final_norm(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    regions.sum_grads_over_tp(module, ctx)
    regions.enter_after(module, ctx)  # into the head's region: the model's output is the whole sequence
    return module


def _split_sequence(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    regions.split_sequence(module, ctx)  # under sequence parallelism only
    return module


def _replicate(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    regions.replicate(module, ctx)
    return module


def _keep(module: nn.Module, ctx: TPContext, memo: dict) -> nn.Module:
    return module


STYLES: dict[str, Callable[[nn.Module, TPContext, dict], nn.Module]] = {
    "enter": _enter_region, "colwise": _colwise, "colwise_qkv": _colwise_qkv, "colwise_packed": _colwise_packed,
    "colwise_gather": _colwise_gather, "rowwise": _rowwise, "rowwise_split": _rowwise_split,
    "vocab_embedding": _vocab_embedding, "vocab_embedding_whole": _vocab_embedding_whole,
    "vocab_head": _vocab_head, "vocab_head_entered": _vocab_head_entered, "sequence_norm": _sequence_norm,
    "final_norm": _final_norm, "split_sequence": _split_sequence, "sum_grads": _sum_grads,
    "replicate": _replicate, "keep": _keep,
}
# need an enclosing "enter"; "colwise_packed" also its blocks' relative sizes (apply_plan's `blocks`)
COLUMN_STYLES = ("colwise", "colwise_qkv", "colwise_packed", "colwise_gather")
PLACING_STYLES = frozenset(STYLES) - {"enter", "split_sequence"}  # say where a module's parameters live


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
        if style in COLUMN_STYLES and not any(found.get(a) == "enter" for a in _ancestors(name)):
            raise ValueError(f"{name} is {style!r} but no enclosing module has style 'enter'")
    return found


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def unplaced_modules(model: nn.Module, found: dict[str, str]) -> list[str]:
    """Modules holding parameters of their own that no placing style names, nor one of a module above."""
    return [name for name, module in model.named_modules()
            if next(module.parameters(recurse=False), None) is not None
            and not any(found.get(a) in PLACING_STYLES for a in (*_ancestors(name), name))]


def apply_plan(model: nn.Module, plan: dict[str, str], ctx: TPContext, place_all: bool = False,
               widths: dict[str, tuple[str, ...]] | None = None,
               blocks: dict[str, tuple[int, ...]] | None = None) -> nn.Module:
    """Swap the modules a plan names for their tensor-parallel versions, in place.

    place_all: first check that the plan says where every parameter goes (a model of another
    architecture fails here, naming the module, before anything changes).
    widths: {module pattern: attribute names} of widths a kept module computes its local shapes
    from, divided by tp (GPT-2's attention splits its fused q|k|v output at `split_size`); an attribute
    "config.<name>" is one the module reads from its config, which it then gets a copy of.
    blocks: {pattern of a "colwise_packed" module: the relative sizes of the blocks its output packs}.
    """
    found = match_plan(model, plan)
    missing = unplaced_modules(model, found) if place_all else []
    if missing:
        kind = type(model.get_submodule(missing[0])).__name__
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"tensor parallelism cannot place {missing[0]!r} ({kind}){more}: "
                         "no entry of the plan names it or a module above it")
    memo: dict = {}
    for name, style in found.items():  # parents before children
        module = model.get_submodule(name)
        make = STYLES[style]
        if style == "colwise_packed":
            make = partial(make, blocks=next(b for p, b in (blocks or {}).items() if fnmatch.fnmatchcase(name, p)))
        try:
            new = make(module, ctx, memo)
        except (TypeError, ValueError) as err:
            raise ValueError(f"tensor parallelism cannot place {name!r} ({type(module).__name__}) "
                             f"as {style!r}: {err}") from None
        if new is not module:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, new)
    _divide_widths(model, widths or {}, ctx)
    return model


def _divide_widths(model: nn.Module, widths: dict[str, tuple[str, ...]], ctx: TPContext) -> None:
    for name, module in model.named_modules():
        for pattern, attrs in widths.items():
            if fnmatch.fnmatchcase(name, pattern):
                for attr in attrs:
                    owner, attr = _width_owner(module, attr)
                    whole = getattr(owner, attr)
                    if whole % ctx.size:
                        raise ValueError(f"{name}.{attr} = {whole} is not divisible by tp {ctx.size}")
                    setattr(owner, attr, whole // ctx.size)


def _width_owner(module: nn.Module, attr: str) -> tuple[object, str]:
    """(object, attribute) of a width: the module's own, or with "config." its config's, on a copy of that
    config made for this module alone (the model and its other modules keep the whole value)."""
    if not attr.startswith("config."):
        return module, attr
    if getattr(module, "tessel_own_config", False) is False:
        module.config = copy.copy(module.config)
        module.tessel_own_config = True
    return module.config, attr.removeprefix("config.")


# ---- helpers for checks and checkpoints --------------------------------------------

def full_tensor(t: torch.Tensor, param: torch.Tensor, ctx: TPContext) -> torch.Tensor:
    """The whole logical tensor of `t` (a parameter or its gradient) from its tp shards; a copy."""
    packed = packed_dims(param).get("tp")
    if packed is not None and ctx.group is not None:
        dim, blocks = packed
        ranks = comm.all_gather_dim(t.detach(), dim, ctx.group).chunk(ctx.size, dim)  # [r0: q k v | r1: q k v ..]
        sizes = block_sizes(blocks, t.size(dim))
        # each block whole again (its pieces in rank order), the blocks in order
        return torch.cat([torch.cat([r.split(sizes, dim)[b] for r in ranks], dim) for b in range(len(blocks))], dim)
    dim = shard_dims(param).get("tp")
    if dim is None or ctx.group is None:
        return t.detach().clone()
    full = comm.all_gather_dim(t.detach(), dim, ctx.group)
    logical = logical_shape(param)
    if logical is not None:
        full = full.narrow(dim, 0, logical[dim])  # drop vocabulary padding
    return full


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
