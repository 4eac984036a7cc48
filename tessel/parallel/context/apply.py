"""Context parallelism on a model: the reference GPT's attention core, or a Hugging Face model's attention.

The model stays the plain single-device module; only attention changes.
Everything else in a transformer acts on each token alone (norms, MLPs, the
head, the loss), so it runs unchanged on a rank's chunks. Two things need the
whole sequence: attention (ring or Ulysses, tessel.parallel.context.context)
and positions (each rank's rotary angles are those of its own chunks); an MoE
block's capacity and balance statistics are the third (tessel.parallel.context.moe).

- The reference GPT: Attention.core (rotary, shared kv heads, causal attention)
  is replaced on the instance, as selective recompute replaces it
  (tessel.parallel.recompute), so parameter names never change.
- A Hugging Face model (any family tessel.hf.context accepts): attention is transformers' own attention
  interface, a function registered by name (transformers.AttentionInterface) and
  chosen through the model's attn_implementation; the model is called with this
  rank's position_ids (a rotary embedding reads them, a learned position
  embedding such as GPT-2's looks them up; a pipeline stage after the first
  takes them too, beside its hidden states) and the CPContext as a
  keyword argument, which transformers hands every attention call. A custom
  attention has no mask function registered, so transformers builds no mask:
  causality, and a layer's sliding window (the `sliding_window` keyword every
  attention implementation takes), come from the positions, inside the function.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from tessel.config import ParallelConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.models.gpt import Attention, apply_rotary
from tessel.parallel.context.context import CPContext
from tessel.parallel.context.kernel import Scores
from tessel.parallel.plan import Plan

HF_ATTENTION = "tessel_context_parallel"  # its name in transformers' AttentionInterface
HF_KWARG = "tessel_cp"  # the keyword transformers passes through to it


class ContextParallelCore:
    """The reference GPT's Attention.core on a cp rank: rotary at this rank's positions, then attention over
    the whole sequence (ring or Ulysses)."""

    def __init__(self, ctx: CPContext):
        self.ctx = ctx

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor, mask: None = None) -> torch.Tensor:
        # q (B, nh, T, hs), k and v (B, nkv, T, hs): this rank's T tokens; cos, sin: the model's whole tables;
        # mask: always None (packed documents, which give one, are refused under cp by tessel.config)
        at = self.ctx.positions(q.size(-2), cos.device)
        cos, sin = cos[at], sin[at]
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return self.ctx.attention(q, k, v)


def context_parallel_gpt(model: nn.Module, ctx: CPContext) -> None:
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = ContextParallelCore(ctx)


def hf_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention interface: q (B, H, T, D), k and v (B, Hkv, T, D), rotary applied at the
    positions the model was called with -> ((B, T, H, D), no weights). The mask is None (see above); the
    layer's sliding window and soft-cap come as keywords, as every attention implementation takes them.
    What tessel.config refuses before any process starts (tessel.hf.context) is refused here too, should a
    model handed to tessel.parallelize bring it anyway: a mask of the model's own making, dropout, a
    non-causal layer."""
    ctx: CPContext = kwargs[HF_KWARG]
    name = type(module).__name__
    if attention_mask is not None:
        raise ValueError(f"context parallelism: {name} hands its attention a mask of its own, which ring and "
                         "Ulysses attention would not apply")
    if dropout or getattr(module, "is_causal", True) is False or kwargs.get("is_causal") is False:
        raise ValueError(f"context parallelism computes causal attention without dropout; {name} asks for "
                         f"{'dropout' if dropout else 'non-causal attention'}")
    scores = Scores(window=sliding_window, softcap=softcap)
    return ctx.attention(query, key, value, scaling, scores).transpose(1, 2).contiguous(), None


def context_parallel_hf(model: nn.Module, ctx: CPContext) -> None:
    from transformers import AttentionInterface  # deferred: transformers loads only for Hugging Face models
    AttentionInterface.register(HF_ATTENTION, hf_attention)  # idempotent: the same function under its name
    model.set_attn_implementation(HF_ATTENTION)

    def with_positions(mod: nn.Module, args: tuple, kwargs: dict):
        # no key/value cache: under full recompute a layer's second forward would append its keys to the
        # first's (transformers caches by default, in training too), and a rank's keys must be its chunks
        extra = {HF_KWARG: ctx, "use_cache": False}
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if ctx.size > 1 and kwargs.get("position_ids") is None:
            extra["position_ids"] = ctx.positions(ids.size(1), ids.device).unsqueeze(0)  # (1, T)
        return args, {**kwargs, **extra}

    model.register_forward_pre_hook(with_positions, with_kwargs=True)


def apply_context_parallel(plan: Plan, mesh: Mesh, parallel: ParallelConfig, family: ModelFamily) -> Plan:
    """tessel.apply's step for cp > 1: attention over the whole sequence from each rank's chunks, rotary at
    each rank's own positions. Weights stay whole: their gradients are averaged over cp like dp's (TOKEN_AXES)."""
    if mesh.size("cp") > 1:
        plan.cp = context_parallel(plan.model, mesh, parallel.cp_mode, hf=family.transformers_attention)
    return plan


def context_parallel(model: nn.Module, mesh: Mesh, mode: str, hf: bool) -> CPContext:
    """Makes `model`'s attention context-parallel over the mesh's cp axis; returns the context."""
    ctx = CPContext.from_mesh(mesh, mode)
    (context_parallel_hf if hf else context_parallel_gpt)(model, ctx)
    return ctx


def whole_sequences(ctx: CPContext, generate: Callable) -> Callable:
    """A runner's generate under cp: every cp rank runs the same prompt whole, attention on the rank."""
    def generate_whole(*args, **kwargs):
        with ctx.whole_sequences():
            return generate(*args, **kwargs)
    return generate_whole
