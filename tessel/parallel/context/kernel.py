"""One block of attention that also returns its log-sum-exp, its backward, and the online-softmax merge.

Ring attention computes a rank's queries against one key/value block at a
time and never holds the whole score matrix. Each block's result is an output
O_b and the log-sum-exp of its scores L_b (per query row); blocks merge exactly
by L = log(e^L_1 + e^L_2), O = O_1 e^(L_1 - L) + O_2 e^(L_2 - L) (Milakov and
Gimelshein 2018, "Online normalizer calculation for softmax"; Dao et al. 2022,
FlashAttention). Backward needs no per-block state: with the
merged O and L, a block's softmax is exp(S_b - L), and its gradients are the
FlashAttention backward of that block given the final O and L (Dao et al.
2022, its backward pass), so blocks are recomputed, never stored.

On CPU the block runs torch's fused flash kernel (no T x T scores in memory,
the kernel scaled_dot_product_attention itself uses there); elsewhere the same
mathematics written out (`math_block`), which is also the reference the
kernel is tested against.

A Hugging Face family may do more to its scores than scale them and mask the future (Scores): a sliding
window (Mistral, Gemma 2/3, Cohere 2, ...: a query sees only its `window` latest keys) and soft-capping
(Gemma 2's `cap * tanh(s / cap)`, on the scaled scores before the mask). Neither fits the fused kernel, so
such a block is the written-out mathematics with its mask made from the global positions of its queries and
keys (`masked_block`): a row the window hides entirely gives an empty block (out 0, log-sum-exp -inf), which
the merge weighs by 0.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

Block = tuple[torch.Tensor, torch.Tensor]  # out (B, H, Tq, D), lse (B, H, Tq) in fp32


@dataclass(frozen=True)
class Scores:
    """What attention does to its scaled scores besides the causal mask, as transformers hands it to its
    attention interface (the `sliding_window` and `softcap` keywords): `window`, the keys a query sees
    (itself and the window-1 before it: transformers' sliding_window_overlay, q - k < window), and `softcap`,
    cap * tanh(s / cap) on the scaled scores before the mask (Gemma 2's attn_logit_softcapping)."""
    window: int | None = None
    softcap: float | None = None

    @property
    def plain(self) -> bool:
        """Causal attention alone: the fused kernel's case."""
        return self.window is None and self.softcap is None

    def allowed(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """(Tq, Tk) boolean: which keys (at global positions k_pos) each query (at q_pos) sees."""
        ahead = q_pos.unsqueeze(1) - k_pos.unsqueeze(0)  # how far each key lies behind each query
        seen = ahead >= 0
        return seen if self.window is None else seen & (ahead < self.window)


PLAIN = Scores()


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, nkv, T, D) -> (B, heads, T, D): grouped-query attention shares each kv head with heads/nkv queries."""
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def fold_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """The gradient of repeat_kv: (B, heads, T, D) -> (B, nkv, T, D), summed over each kv head's queries."""
    if grad.size(1) == kv_heads:
        return grad
    B, H, T, D = grad.shape
    return grad.view(B, kv_heads, H // kv_heads, T, D).sum(2)


def _fused(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether torch's fused CPU kernel takes the block: on the CPU, with values as wide as queries and keys
    (DeepSeek's latent attention has narrower values, which the kernel refuses)."""
    return q.device.type == "cpu" and v.size(-1) == q.size(-1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Block:
    """Softmax(q k^T * scale [causal]) v and its log-sum-exp; q (B, H, Tq, D), k and v (B, H, Tk, D)."""
    if _fused(q, v):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return out, lse.float()
    return math_block(q, k, v, causal, scale)


def attend_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one block, given the MERGED output and log-sum-exp of these queries over all blocks."""
    if _fused(q, v):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, causal, scale=scale)
    return math_block_backward(dout, q, k, v, out, lse, causal, scale)


def _scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    if causal:  # the block's own diagonal: query i sees keys 0..i (Tq == Tk)
        s = s.masked_fill(torch.ones_like(s, dtype=torch.bool).triu(1), float("-inf"))
    return s


def math_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float) -> Block:
    s = _scores(q, k, causal, scale)
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    out = torch.exp(s - lse.unsqueeze(-1)) @ v.float()
    return out.to(q.dtype), lse


def math_block_backward(dout, q, k, v, out, lse, causal, scale) -> tuple[torch.Tensor, ...]:
    p = torch.exp(_scores(q, k, causal, scale) - lse.unsqueeze(-1))  # this block's share of the softmax
    dout = dout.float()
    dv = p.transpose(-2, -1) @ dout
    dp = dout @ v.float().transpose(-2, -1)
    ds = p * (dp - (dout * out.float()).sum(-1, keepdim=True))  # D_i = rowsum(dO * O) of the merged output
    dq = ds @ k.float() * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _capped(q: torch.Tensor, k: torch.Tensor, scale: float, softcap: float | None) -> torch.Tensor:
    s = (q.float() @ k.float().transpose(-2, -1)) * scale  # (B, H, Tq, Tk)
    return s if softcap is None else torch.tanh(s / softcap) * softcap


def masked_block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
                 softcap: float | None) -> Block:
    """softmax(cap(q k^T * scale) where `allowed`) v and its log-sum-exp; allowed (Tq, Tk). A row with no key
    allowed gives out 0 and lse -inf (merge weighs it by e^-inf = 0)."""
    s = _capped(q, k, scale, softcap).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Tq)
    p = torch.exp(s - lse.masked_fill(lse.isneginf(), 0.0).unsqueeze(-1))  # 0 on a row with nothing allowed
    return (p @ v.float()).to(q.dtype), lse


def masked_block_backward(dout, q, k, v, out, lse, allowed: torch.Tensor, scale: float,
                          softcap: float | None) -> tuple[torch.Tensor, ...]:
    """dq, dk, dv of one masked block, given the MERGED output and log-sum-exp (finite: a query always sees
    itself); the soft-cap's derivative is 1 - tanh^2."""
    capped = _capped(q, k, scale, softcap)
    p = torch.exp(capped.masked_fill(~allowed, float("-inf")) - lse.unsqueeze(-1))
    dout = dout.float()
    dv = p.transpose(-2, -1) @ dout
    ds = p * (dout @ v.float().transpose(-2, -1) - (dout * out.float()).sum(-1, keepdim=True))
    if softcap is not None:
        ds = ds * (1 - (capped / softcap) ** 2)
    dq = ds @ k.float() * scale
    dk = ds.transpose(-2, -1) @ q.float() * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge(acc: Block | None, block: Block) -> Block:
    """Online softmax: two partial attentions over disjoint key sets -> their attention over the union."""
    if acc is None:
        return block[0].float(), block[1]
    out, lse = acc
    b_out, b_lse = block
    new = torch.logaddexp(lse, b_lse)
    out = out * torch.exp(lse - new).unsqueeze(-1) + b_out.float() * torch.exp(b_lse - new).unsqueeze(-1)
    return out, new
