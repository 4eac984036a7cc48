"""train.fused_loss on a model: its head hands out its input, and the loss does the head's matmul chunk by chunk.

The head's forward is replaced on its instance (as tessel.parallel.recompute replaces forwards: no wrapper
module, so parameter names stay the model's own) by what its matmul would take: the hidden states, entered
into the tensor-parallel region as the head would enter them (Megatron's f, or the sequence-parallel
all-gather), so the gradient that the fused loss gives them leaves through the head's own tp entry. The model
(or a pipeline's last stage) then returns (B, T, C) instead of logits, and what consumed logits takes them
from here: the loss (FusedLoss, kernel.py's chunked linear cross-entropy, vocabulary-parallel under tp), and
sampling (HeadLogits: the head's matmul on the hidden states it is given, for a window's last position).

Both read the head's parameters at each call, never a copy: ZeRO swaps what a parameter holds, and a tied
head's weight is the embedding's. Under ZeRO-3 the root unit that holds the head is freed after a forward
without gradients (evaluation, sampling), so they read it inside `whole()`, which ZeRO sets to its root
gather (tessel.parallel.zero.apply).

What a Hugging Face causal LM does to the head's output before returning it: a linear scaling (Granite's
`logits / logits_scaling`, Cohere's `logits * logit_scale`) commutes with the matmul, so applied to the
hidden states it gives the same logits (s * (h W^T) = (s h) W^T) and the same gradients; Gemma 2's
soft-capping (tanh) does not, so it moves into the loss and the model's own is switched off (take_softcap).
What a family's forward does after its head is read from its source (tessel.hf.head) before any process starts.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessel.config import ParallelConfig
from tessel.mesh import Mesh
from tessel.parallel.fused_loss.kernel import Vocab, linear_cross_entropy
from tessel.parallel.pipeline.schedules import Placement, is_vshape
from tessel.parallel.plan import Plan
from tessel.parallel.tensor.tensor_parallel import FullLogits


class HeadInput:
    """The head's forward, replaced on its instance: the input its matmul would take, entered into the tp
    region (`enter`: the head's own f or sequence-parallel all-gather; None where it has none)."""

    def __init__(self, enter: Callable[[torch.Tensor], torch.Tensor] | None):
        self.enter = enter

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.enter is None else self.enter(x)


class FusedHead:
    """A head whose matmul moved into the loss: its parameters, where its rows sit in the vocabulary, and
    `whole` (a context in which its weight can be read; ZeRO-3 sets its root gather)."""

    def __init__(self, head: nn.Module, vocab_size: int, softcap: float | None = None):
        ctx = getattr(head, "ctx", None)  # a ColumnParallelLinear's TPContext (tessel.parallel.tensor)
        rows = head.weight.size(0)
        self.head, self.softcap = head, softcap
        self.vocab = Vocab(start=ctx.rank * rows if ctx is not None else 0, size=vocab_size,
                           group=ctx.group if ctx is not None else None, softcap=softcap)
        self.whole: Callable[[], ContextManager] = contextlib.nullcontext

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss of the head's input (B, T, C) against targets (B, T)."""
        with self.whole():
            return linear_cross_entropy(hidden, self.head.weight, self.head.bias, targets, self.vocab)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The head's logits of `hidden` (this rank's vocabulary rows under tp), soft-capped where the model
        caps them: for sampling, on the positions it needs."""
        with self.whole():
            z = F.linear(hidden, self.head.weight, self.head.bias)
        return z if self.softcap is None else torch.tanh(z / self.softcap) * self.softcap


def fuse_head(head: nn.Module, vocab_size: int, softcap: float | None = None) -> FusedHead:
    """Replace the head's forward by HeadInput; the FusedHead that scores (and samples from) its input."""
    if not isinstance(head.forward, HeadInput):
        if getattr(head, "in_out", False) or getattr(head, "gather_output", False):
            raise ValueError(f"the fused loss takes a head that stores its weight [vocab, hidden] and keeps its "
                             f"logits split over tp; {type(head).__name__} does not")
        ctx = getattr(head, "ctx", None)
        head.forward = HeadInput(ctx.enter if ctx is not None and head.enter else None)
    return FusedHead(head, vocab_size, softcap)


def apply_fused_loss(plan: Plan, mesh: Mesh, parallel: ParallelConfig, fused_loss: bool, vocab_size: int,
                     max_seq_len: int) -> Plan:
    """tessel.apply's step for train.fused_loss: the head hands out its input and the loss does its matmul,
    chunked over tokens (vocabulary-parallel under tp), so the fp32 logits never exist. After the pipeline's
    cut: only the rank holding the head (the last stage) changes anything. Sampling takes the head's logits from
    its input: the model's whole-vocabulary logits, or a pipeline's last stage through gather_vocab."""
    if not fused_loss:
        return plan
    if mesh.size("pp") > 1:
        place = Placement(mesh.size("pp"), len(plan.model), mesh.coord("pp"), is_vshape(parallel.schedule))
        last = [chunk for c, chunk in enumerate(plan.model) if place.is_last(c)]
        plan.fused = fuse_model_head(last[0], vocab_size) if last else None
        if plan.fused is not None:  # the last stage samples from its output, sliced to the last position
            plan.loss_fn, plan.gather_vocab = plan.fused.loss, GatherAfterHead(plan.fused, plan.gather_vocab)
        return plan
    plan.fused = fuse_model_head(plan.model, vocab_size)
    plan.loss_fn = plan.fused.loss
    logits = LogitsOf(plan.model, plan.fused)
    plan.full_logits = logits if mesh.size("tp") == 1 else \
        FullLogits(logits, plan.fused.head.ctx, vocab_size, max_seq_len)
    return plan


def fuse_model_head(model: nn.Module, vocab_size: int) -> FusedHead | None:
    """fuse_head on the model's (or a pipeline chunk's) output head, with its soft-capping taken over and its
    own loss refused; None where it holds no head."""
    head = output_head(model)
    if head is None:
        return None
    refuse_labels(model)
    return fuse_head(head, vocab_size, take_softcap(model))


def output_head(model: nn.Module) -> nn.Module | None:
    """The model's output head: a transformers model's get_output_embeddings(), the reference GPT's lm_head
    (None on a pipeline stage that does not hold it)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if get is not None else getattr(model, "lm_head", None)
    return head if isinstance(getattr(head, "weight", None), torch.Tensor) else None  # not a stand-in


def take_softcap(model: nn.Module) -> float | None:
    """A transformers model's final logit soft-capping (Gemma 2's tanh), switched off in the model: the fused
    loss applies it to each chunk of logits (on the hidden states the head now returns it would be wrong).
    Only this model's config object changes (a pipeline stage holds its own copy)."""
    config = getattr(model, "config", None)
    cap = getattr(config, "final_logit_softcapping", None)
    if cap is not None:
        config.final_logit_softcapping = None
    return cap


def refuse_labels(model: nn.Module) -> None:
    """A transformers model computes its own loss from `labels=` on what its head returns: hidden states now."""

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if kwargs.get("labels") is not None:
            raise ValueError("under train.fused_loss the model's head returns its input (the hidden states), so "
                             "the model's own loss (labels=...) would be wrong: score them with the runner's "
                             "loss_fn (tessel.parallel.fused_loss)")

    model.register_forward_pre_hook(hook, with_kwargs=True)


class LogitsOf:
    """model(idx) -> the head's logits: a model whose head hands out its input, for sampling (tessel.parallel.
    tensor_parallel.FullLogits gathers them over tp)."""

    def __init__(self, model: nn.Module, fused: FusedHead):
        self.model, self.fused = model, fused

    def __call__(self, idx: torch.Tensor) -> torch.Tensor:
        return self.fused.logits(self.model(idx))


class GatherAfterHead:
    """A pipeline's last stage output (the head's input, at the positions sampling needs) -> its logits, then
    the vocabulary gathered over tp where `gather` is given (the runner's gather_vocab)."""

    def __init__(self, fused: FusedHead, gather: Callable[[torch.Tensor], torch.Tensor] | None):
        self.fused, self.gather = fused, gather

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.fused.logits(hidden)
        return logits if self.gather is None else self.gather(logits)
