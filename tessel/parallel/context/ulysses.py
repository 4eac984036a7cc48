"""DeepSpeed-Ulysses (Jacobs et al. 2023, "DeepSpeed Ulysses: System Optimizations for Enabling Training of
Extreme Long Sequence Transformer Models"): around attention, an all-to-all swaps the sequence
split for a head split, so each cp rank attends over the whole sequence with 1/cp of the heads; a second
all-to-all swaps back.

q, k and v arrive as (B, H, 2c, D) per rank, holding chunks r and 2cp-1-r
(tessel.parallel.context.layout). The all-to-all sends head group j to rank j;
what comes back from rank s is chunks s and 2cp-1-s of this rank's heads, and
they are laid in their places in the sequence, so attention sees positions in
order and the causal mask is the plain one. The way back is the mirror image.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # first: empty_like keeps a strided input's strides, and the exchange writes rows
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


class UlyssesAllToAll(torch.autograd.Function):
    """(cp, ...) -> (cp, ...): slice j goes to rank j, slice s of the result came from rank s (Jacobs et al.
    2023). Its own adjoint: the gradient travels back by the same exchange."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_to_all(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group), None


def seq_to_heads(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """(B, H, 2c, D), this rank's two chunks of all heads -> (B, H/cp, 2*cp*c, D), every position in order of
    this rank's head group."""
    B, H, T, D = x.shape
    c = T // 2
    parts = UlyssesAllToAll.apply(x.reshape(B, cp, H // cp, T, D).transpose(0, 1), group)  # (cp, B, H/cp, 2c, D)
    parts = parts.reshape(cp, B, H // cp, 2, c, D)
    head = parts[:, :, :, 0].permute(1, 2, 0, 3, 4)  # chunks 0 .. cp-1: source s's head chunk is chunk s
    tail = parts[:, :, :, 1].flip(0).permute(1, 2, 0, 3, 4)  # chunks cp .. 2cp-1: chunk 2cp-1-s, reversed
    return torch.cat((head, tail), 2).reshape(B, H // cp, 2 * cp * c, D)


def heads_to_seq(x: torch.Tensor, cp: int, group) -> torch.Tensor:
    """The inverse of seq_to_heads: (B, H/cp, T, D) -> (B, H, 2c, D), this rank's chunks of all heads."""
    B, Hl, T, D = x.shape
    c = T // (2 * cp)
    chunks = x.reshape(B, Hl, 2, cp, c, D)
    head = chunks[:, :, 0].permute(2, 0, 1, 3, 4)  # (cp, B, Hl, c, D): to rank s goes chunk s ...
    tail = chunks[:, :, 1].permute(2, 0, 1, 3, 4).flip(0)  # ... and chunk 2cp-1-s
    parts = UlyssesAllToAll.apply(torch.stack((head, tail), 3), group)  # (cp, B, Hl, 2, c, D): j sent head group j
    return parts.permute(1, 0, 2, 3, 4, 5).reshape(B, cp * Hl, 2 * c, D)
