"""A GPT decoder in the style of modern open models, for one device.

RMSNorm, rotary position embeddings, grouped-query causal attention through
scaled_dot_product_attention (or within a sliding window: tessel.models.window;
within each of the packed documents of a sequence: tessel.models.documents),
a SwiGLU MLP, optional tied embeddings and optional mixture-of-experts blocks. Nothing here knows about parallelism:
`tessel.parallelize` swaps layers and wraps modules from the outside, and the
forward code below is written so that the swaps need no change here (head
counts are read from tensor shapes, not from the config).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessel.config import ModelConfig
from tessel.models.documents import document_mask, masked_attention
from tessel.models.moe import MoE
from tessel.models.window import window_attention


def rotary_tables(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # (T, hs/2)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, nh, T, hs); rotate each (even, odd) pair by its position's angle
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.size(-2)], sin[: x.size(-2)]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.n_head
        self.window = cfg.sliding_window  # None: every earlier token (tessel.models.window)
        self.wq = nn.Linear(cfg.d_model, cfg.n_head * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_head * self.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        B, T, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds a slice of them
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, nkv, T, hs)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        y = self.core(q, k, v, cos, sin, mask)  # (B, nh, T, hs)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
             sin: torch.Tensor, mask=None) -> torch.Tensor:
        """Rotary, the kv heads shared, causal attention (within the sliding window, if any; where `mask`
        allows, if given: packed documents): what selective recompute runs again."""
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if k.size(1) != q.size(1):  # grouped-query attention: share each kv head
            k = k.repeat_interleave(q.size(1) // k.size(1), dim=1)
            v = v.repeat_interleave(q.size(1) // v.size(1), dim=1)
        if mask is not None:  # packed documents (tessel.models.documents); the window, if any, is in it
            return masked_attention(q, k, v, mask)
        if self.window is not None and self.window < q.size(-2):
            return window_attention(q, k, v, self.window)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class SwiGLU(nn.Module):
    def __init__(self, d_model: int, d_ff: int):
        super().__init__()
        self.w_gate = nn.Linear(d_model, d_ff, bias=False)
        self.w_up = nn.Linear(d_model, d_ff, bias=False)
        self.w_down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        if moe:
            self.mlp = MoE(cfg)
        else:
            self.mlp = SwiGLU(cfg.d_model, cfg.ffn_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.layers = nn.ModuleList(
            Block(cfg, moe=cfg.n_experts > 0 and (i + 1) % cfg.moe_every == 0) for i in range(cfg.n_layer)
        )
        self.norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight
        cos, sin = rotary_tables(cfg.d_model // cfg.n_head, cfg.max_seq_len, cfg.rope_theta)
        # not saved in checkpoints: rebuilt from the config
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        std = self.cfg.init_std
        for name, p in self.named_parameters():
            if p.dim() < 2:
                nn.init.ones_(p)  # norm weights
            elif name.endswith(("wo.weight", "w_down.weight")):
                # GPT-2: scale residual projections by depth so the stream's variance stays put
                nn.init.normal_(p, std=std / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        # idx: (B, T) token ids -> logits (B, T, vocab). A pipeline stage is this model with
        # the modules it does not hold set to None (and blocks removed from `layers`): without
        # the embedding it takes hidden states (B, T, C), without norm and head it returns them.
        x = self.tok_emb(idx) if self.tok_emb is not None else idx  # (B, T, C)
        mask = self.attention_mask(idx)  # one for every block
        for layer in self.layers:
            x = layer(x, self.rope_cos, self.rope_sin, mask)
        if self.norm is not None:
            x = self.norm(x)
        return self.lm_head(x) if self.lm_head is not None else x

    def attention_mask(self, idx: torch.Tensor):
        """None (causal attention, or the sliding window's band, made by each block), or with
        model.document_separator the mask of the packed documents in idx (B, T). Config refuses a pipeline,
        whose later stages get hidden states instead of token ids."""
        if self.cfg.document_separator is None:
            return None
        return document_mask(idx, self.cfg.document_separator, self.cfg.sliding_window)

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 40, generator: torch.Generator | None = None) -> torch.Tensor:
        for _ in range(new_tokens):
            window = idx[:, -self.cfg.max_seq_len:]
            logits = self(window)[:, -1, :] / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(F.softmax(logits.float(), dim=-1), 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token loss over every position; logits (B, T, V), targets (B, T)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def count_params(model: nn.Module, exclude_embedding: bool = False) -> int:
    seen, n = set(), 0
    for name, p in model.named_parameters():
        if id(p) in seen or (exclude_embedding and name.startswith("tok_emb")):
            continue
        seen.add(id(p))
        n += p.numel()
    return n


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward = 3x forward).

    Every matmul weight costs 2 FLOPs per token forward (the embedding lookup
    costs none, the output head does count). Attention scores and the weighted
    sum add 2 * 2 * T * d_model per layer forward (Kaplan et al. 2020; PaLM's
    6N + 12 L d T). MoE blocks count only the top_k experts a token visits, and the shared ones.
    """
    d, L = cfg.d_model, cfg.n_layer
    hd = d // cfg.n_head
    attn = d * (cfg.n_head * hd) * 2 + d * (cfg.kv_heads * hd) * 2
    dense_mlp = 3 * d * cfg.ffn_dim
    n_moe = sum(1 for i in range(L) if cfg.n_experts > 0 and (i + 1) % cfg.moe_every == 0)
    moe_mlp = (cfg.moe_top_k + cfg.n_shared_experts) * dense_mlp + d * cfg.n_experts  # experts visited + router
    matmul_params = L * attn + (L - n_moe) * dense_mlp + n_moe * moe_mlp + d * cfg.vocab_size
    # the band's keys; packed documents (model.document_separator) shorten attention by an amount each batch's
    # separators decide, so their keys count as the whole sequence's (as tessel.models.flops counts them)
    keys = seq_len if cfg.sliding_window is None else min(seq_len, cfg.sliding_window)
    return 6 * matmul_params + 12 * L * d * keys
