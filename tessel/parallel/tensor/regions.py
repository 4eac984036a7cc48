"""Where a plan acts on a module it keeps: hooks around the module's own call.

Megatron's f and g (Shoeybi et al. 2019, section 3), and sequence
parallelism's all-gather and split (Korthikanti et al. 2022, section 4.2.2),
bracket the regions of column- and row-parallel layers. When the module that
encloses a region is the model's own (a Hugging Face attention or MLP) they
are hooks on its call, never a copy of its forward.

A Hugging Face decoder layer calls its attention with keyword arguments
(`self.self_attn(hidden_states=..., ...)`), so a hook finds the module's input
by position or by the name of its forward's first parameter. The name is read
when the plan is applied, before recompute wraps the forward in a
`(*args, **kwargs)` callable.
"""

from __future__ import annotations

import inspect
from functools import partial
from typing import Callable

import torch
import torch.nn as nn

from tessel.parallel.tensor import comm
from tessel.parallel.tensor.context import TPContext

_NAMED = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def input_name(module: nn.Module) -> str:
    """The name of the first parameter of the module's forward: its input (hidden_states, x, ...)."""
    named = [p for p in inspect.signature(module.forward).parameters.values() if p.kind in _NAMED]
    if not named:
        raise TypeError(f"{type(module).__name__}.forward names no input a hook could find")
    return named[0].name


def on_input(module: nn.Module, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Every call of `module` sees fn(x) for its first input x, passed by position or by name."""
    name = input_name(module)

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        if args:
            return (fn(args[0]), *args[1:]), kwargs
        if name not in kwargs:
            raise TypeError(f"{type(mod).__name__} was called without its input {name!r}")
        return args, {**kwargs, name: fn(kwargs[name])}

    module.register_forward_pre_hook(hook, with_kwargs=True)


def enter_region(module: nn.Module, ctx: TPContext) -> None:
    """One f (or sequence all-gather) for the column-parallel layers inside: q, k and v share it."""
    on_input(module, ctx.enter)


def enter_after(module: nn.Module, ctx: TPContext) -> None:
    """The module's output enters the region of the column-parallel layer after it: f, or under
    sequence parallelism the all-gather g that makes the sequence whole again.

    On a model's final norm, before its vocabulary-parallel head: the base model then returns the
    whole sequence, as its callers expect (GPT-2's reshapes its output to the input's shape).
    """
    module.register_forward_hook(lambda mod, args, out: ctx.enter(out))


def split_sequence(module: nn.Module, ctx: TPContext) -> None:
    """Under sequence parallelism, the module's (whole, replicated) input is split along the sequence:
    Megatron's scatter_to_sequence_parallel_region, whose backward all-gathers the gradient.

    For a model that reads positions and its causal mask from the embedding's output, the embedding
    stays whole and the sequence is split where the residual stream enters the first decoder layer.
    """
    if ctx.sequence_parallel:
        on_input(module, lambda x: comm.scatter_seq(x, ctx.seq_dim, ctx.group))


def sequence_parallel_stage(stage: nn.Module, ctx: TPContext, hidden_input: str | None, first_layer: nn.Module,
                            whole_at: nn.Module | None = None) -> None:
    """A pipeline stage of a model that reads its positions and causal mask from the length of its input
    (a Hugging Face model), under sequence parallelism; stages exchange sequence shards (B, T/tp, C).

    - hidden_input (a stage after the first: the keyword its hidden states arrive by): they are all-gathered
      into the whole sequence the model measures (backward: this rank's slice, the gradient being whole and
      alike on every tp rank), and `first_layer`, this stage's first decoder layer, splits them again, as the
      model's first layer does on the first stage (split_sequence).
    - whole_at (a stage before the last whose model reshapes its final norm's output to the input's (B, T),
      GPT-2): the stand-in of that norm makes the sequence whole, and the stage sends its own slice of what
      the model returns.
    """
    if not ctx.sequence_parallel:
        return
    if hidden_input is not None:
        def gather_hidden(module: nn.Module, args: tuple, kwargs: dict):
            return args, {**kwargs, hidden_input: comm.gather_seq_to_replica(kwargs[hidden_input], ctx.seq_dim,
                                                                              ctx.group)}
        stage.register_forward_pre_hook(gather_hidden, with_kwargs=True)
        split_sequence(first_layer, ctx)
    if whole_at is not None:
        whole_at.register_forward_hook(lambda mod, args, out: comm.gather_seq_to_replica(out, ctx.seq_dim, ctx.group))
        stage.register_forward_hook(lambda mod, args, out: comm.scatter_seq(out, ctx.seq_dim, ctx.group))


def replicate(module: nn.Module, ctx: TPContext) -> None:
    """Computed whole on every tp rank: input, output and parameter gradients are replicated,
    so the gradients need no tp reduction (MoE blocks: experts split over ep, not tp).

    Under sequence parallelism the input arrives sequence-sharded: it is all-gathered
    (backward: this rank's slice of the already whole gradient) and the output split
    again (backward: all-gather). Every rank then routes the same tokens as without
    SP, so MoE capacity and aux losses stay those of the whole micro-batch.
    """
    if ctx.sequence_parallel:
        on_input(module, lambda x: comm.gather_seq_to_replica(x, ctx.seq_dim, ctx.group))
        module.register_forward_hook(lambda mod, args, out: comm.scatter_seq(out, ctx.seq_dim, ctx.group))


def sum_grads_over_tp(module: nn.Module, ctx: TPContext) -> None:
    """Under sequence parallelism a replicated module (a norm) runs on this rank's 1/tp of the
    tokens, so its parameters' gradients are partial sums: each is all-reduced over tp before it
    accumulates, the backward of Megatron's f applied to the parameter (Korthikanti et al. 2022,
    section 4.2.2). The module itself is untouched, whatever its class (torch's norms, LlamaRMSNorm,
    MixtralRMSNorm, ...). After the sum the gradient is whole and identical on every rank, so the
    global norm counts it once (the parameter stays unmarked: replicated)."""
    if ctx.sequence_parallel:
        for p in module.parameters():
            p.register_hook(partial(_summed_over_tp, group=ctx.group))


def sum_partial_grads(module: nn.Module, ctx: TPContext) -> None:
    """A replicated module that each tp rank applies to its own heads only (Qwen3's and Gemma 3's q/k norms,
    one weight of head_dim shared by every head: transformers' replicated_with_grad_allreduce): each rank's
    gradient is its heads' share, so it is all-reduced over tp before it accumulates, with or without
    sequence parallelism (under it the attention's input was gathered first: every rank sees the whole
    sequence, its own heads). The weights stay identical on every rank and unmarked (counted once)."""
    for p in module.parameters():
        p.register_hook(partial(_summed_over_tp, group=ctx.group))


def _summed_over_tp(grad: torch.Tensor, group) -> torch.Tensor:
    return comm.all_reduce(grad.clone(), group)  # a hook must not change the tensor it is given


def refuse_own_loss(model: nn.Module) -> None:
    """A Hugging Face model computes its own loss from `labels=`; under tensor parallelism its logits
    are vocab shards, so that loss would be silently wrong: refuse it (tessel's vocab-parallel loss,
    which never gathers the whole logits, is the runner's loss_fn)."""

    def hook(mod: nn.Module, args: tuple, kwargs: dict):
        if kwargs.get("labels") is not None:
            raise ValueError("under tensor parallelism the logits are split over the vocabulary, so the model's "
                             "own loss (labels=...) would be wrong: score the logits with "
                             "tessel.parallel.tensor.tensor_parallel.VocabParallelLoss (the runner's loss_fn)")

    model.register_forward_pre_hook(hook, with_kwargs=True)
