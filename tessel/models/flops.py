"""Training FLOPs per token of any model, counted from its own parameters: the MFU numerator.

The count of Kaplan et al. 2020 (and PaLM's 6N + 12 L d T): every weight a
token multiplies costs 2 FLOPs forward and 4 backward, and causal attention
adds 2 * 2 * T * (heads * head_dim) per layer forward for the scores and the
weighted sum (counted without the causal halving, as tessel.models.gpt does).
Read from the module instead of a formula, it holds for any architecture:

- a matmul weight is a parameter of two or more dimensions (nn.Linear, GPT-2's
  Conv1D, a stack of experts); vectors (norms, biases) are not counted;
- an embedding is a lookup, no FLOPs, unless the same tensor is also a
  Linear's weight (a tied output head), which then counts once;
- experts stored as one stacked tensor (n_experts, ...) count top_k of
  n_experts: a token visits only the experts its router picks (the reference
  GPT's MoE and transformers' Mixtral, Qwen-MoE and DeepSeek alike, their
  counts read from the config by tessel.hf.blocks); the router and shared
  experts count whole.

For the reference GPT this equals tessel.models.gpt.flops_per_token exactly
(tests/models/test_flops.py).
"""

from __future__ import annotations

import torch.nn as nn

from tessel.config import ModelConfig
from tessel.hf.blocks import read_model
from tessel.hf.shape import read_config


def experts_per_token(cfg: ModelConfig) -> tuple[int, int]:
    """(experts of an MoE block, those a token visits); (0, 0) for a dense model."""
    if cfg.hf_config is None:
        return (cfg.n_experts, cfg.moe_top_k) if cfg.n_experts else (0, 0)
    experts = next((b.experts for b in read_model(read_config(cfg.hf_config)).blocks if b.experts), None)
    return (experts.count, experts.top_k) if experts else (0, 0)


def matmul_params(model: nn.Module, cfg: ModelConfig) -> float:
    """Weights a token is multiplied by in one forward (expert stacks scaled to the experts it visits)."""
    linear = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    lookup = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)} - linear
    n_experts, top_k = experts_per_token(cfg)
    total = 0.0
    for p in model.parameters():  # each tensor once: a tied head counts once
        if p.dim() < 2 or id(p) in lookup:
            continue
        if n_experts and p.dim() >= 3 and p.shape[0] == n_experts:
            total += p.numel() * top_k / n_experts
        else:
            total += p.numel()
    return total


def attention_width(cfg: ModelConfig) -> float:
    """heads * head_dim: d_model, unless a Hugging Face config sets its own head_dim; under multi-head latent
    attention (DeepSeek) heads x the mean of a query/key head's and a value head's width (the scores contract
    the one, the weighted sum the other)."""
    if cfg.hf_config is not None:
        a = read_model(read_config(cfg.hf_config)).blocks[0].attention
        return a.heads * (a.qk_dim + a.v_dim) / 2
    return cfg.d_model


def attended_keys(cfg: ModelConfig, seq_len: int) -> int:
    """The keys the attention FLOPs count per query: the sequence, or the sliding window where it is shorter
    (model.sliding_window: the kernel skips the blocks outside the band). Packed documents
    (model.document_separator) are not counted: the keys they leave out depend on where each batch's
    separators fall, which a count per token of the model cannot know, so MFU counts their attention whole."""
    return seq_len if cfg.sliding_window is None else min(seq_len, cfg.sliding_window)


def training_flops_per_token(model: nn.Module, cfg: ModelConfig, seq_len: int) -> float:
    """Forward + backward FLOPs per token (3x forward) of `model` (any device, the meta device too)."""
    return 6 * matmul_params(model, cfg) + 12 * cfg.n_layer * attention_width(cfg) * attended_keys(cfg, seq_len)
