"""Causal attention within a sliding window: each query sees itself and the window - 1 keys before it.

Longformer's local attention (Beltagy et al. 2020) and Mistral 7B (Jiang et al.
2023) attend within a window, so a layer's work grows with T x window rather
than T^2. FlexAttention (torch.nn.attention.flex_attention; Dong et al. 2024,
"Flex Attention: A Programming Model for Generating Optimized Attention
Kernels") computes it from a mask function: its block mask tells the kernel
which blocks of the score matrix hold any allowed score, and the others are
never computed. Its fused kernel comes from torch.compile, so on a GPU the
function is compiled once, by itself (inside a compiled block it is part of
that graph). torch has no FlexAttention backward on the CPU, so there (and in
a torch without it) scaled_dot_product_attention takes the same band as an
explicit boolean mask: every score computed, those outside masked, the same
softmax.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

try:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
except ImportError:  # a torch before 2.5: the explicit mask below
    create_block_mask = flex_attention = None


def in_window(window: int):
    """FlexAttention's mask function: key kv_idx is visible to query q_idx (causal, at most window - 1 back)."""
    def mask(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)
    return mask


@functools.lru_cache(maxsize=16)
def band(seq_len: int, window: int, device: torch.device) -> torch.Tensor:
    """The same band as a (T, T) boolean mask, True where a query may attend."""
    i = torch.arange(seq_len, device=device)
    return in_window(window)(None, None, i[:, None], i[None, :])


@functools.lru_cache(maxsize=16)
def _block_mask(seq_len: int, window: int, device: torch.device):
    return create_block_mask(in_window(window), None, None, seq_len, seq_len, device=device)


@functools.lru_cache(maxsize=1)
def _compiled_flex():
    return torch.compile(flex_attention, dynamic=False)


def flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """FlexAttention's fused kernel: flex_attention compiled by itself, or inside a compiled region (a compiled
    block) traced into that region's graph."""
    if torch.compiler.is_compiling():
        return flex_attention(q, k, v, block_mask=block_mask)
    return _compiled_flex()(q, k, v, block_mask=block_mask)


def uses_flex(q: torch.Tensor) -> bool:
    """FlexAttention where torch has it with a backward: on a GPU."""
    return flex_attention is not None and q.device.type == "cuda"


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int) -> torch.Tensor:
    """Softmax attention of q (B, H, T, D) over k, v (B, H, T, D) within the causal window; (B, H, T, D)."""
    T = q.size(-2)
    if uses_flex(q):
        return flex(q, k, v, _block_mask(T, window, q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=band(T, window, q.device))
