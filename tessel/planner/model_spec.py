"""The model as the planner sees it: sizes of the reference GPT, from a recipe or a preset.

The planner prices tessel's own model (RMSNorm, rotary attention with grouped
KV heads, SwiGLU MLP, optional MoE blocks), so a plan's `--out` recipe trains
exactly the model that was priced. GPT-3 sizes follow Brown et al. 2020,
Table 2.1 (layers, d_model, heads, batch in tokens, 2048-token context); the
SwiGLU width ~8/3 d_model keeps the 8 d^2 MLP parameters of GPT-3's 4x GELU
MLP. The vocabulary is GPT-2's 50257 padded to 50304 (a multiple of 128).
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per step, the preset's (or recipe's) default

    # ---- parameter counts ----------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.cfg.d_model // self.cfg.n_head

    @property
    def attn_params(self) -> int:
        c = self.cfg
        return 2 * c.d_model * c.n_head * self.head_dim + 2 * c.d_model * c.kv_heads * self.head_dim

    @property
    def mlp_params(self) -> int:
        return 3 * self.cfg.d_model * self.cfg.ffn_dim

    def is_moe(self, layer: int) -> bool:
        c = self.cfg
        return c.n_experts > 0 and (layer + 1) % c.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.cfg.n_layer))

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(dense, expert) parameters of one block; norms count as dense."""
        c = self.cfg
        dense = self.attn_params + 2 * c.d_model
        if self.is_moe(layer):
            return dense + c.d_model * c.n_experts, c.n_experts * self.mlp_params  # router is dense
        return dense + self.mlp_params, 0

    @property
    def embedding_params(self) -> int:
        return self.cfg.vocab_size * self.cfg.d_model

    @property
    def head_params(self) -> int:
        """Final norm + output head (shared with the embedding when tied)."""
        c = self.cfg
        return c.d_model + (0 if c.tie_embeddings else c.vocab_size * c.d_model)

    @property
    def total_params(self) -> int:
        layers = sum(sum(self.layer_params(i)) for i in range(self.cfg.n_layer))
        return layers + self.embedding_params + self.head_params

    # ---- FLOPs per token ----------------------------------------------------
    def layer_fwd_flops_per_token(self, layer: int, capacity_factor: float | None = None) -> float:
        """Forward FLOPs of one block per token: 2 per matmul weight + causal attention.

        Attention scores and the weighted sum cost 2 * 2 * T * d (Kaplan et al.
        2020, counted without the causal halving, as tessel.models.gpt does).
        An MoE block computes top_k experts per token, padded to the capacity
        factor when given (fixed-capacity dispatch computes the padding too).
        """
        c = self.cfg
        f = 2 * self.attn_params + 4 * self.seq_len * c.d_model
        if self.is_moe(layer):
            pad = capacity_factor if capacity_factor is not None else 1.0
            f += 2 * c.d_model * c.n_experts + 2 * c.moe_top_k * pad * self.mlp_params
        else:
            f += 2 * self.mlp_params
        return f

    @property
    def head_fwd_flops_per_token(self) -> float:
        return 2 * self.cfg.d_model * self.cfg.vocab_size

    def model_flops_per_token(self) -> float:
        """Training FLOPs per token (3x forward, no recomputation): the MFU numerator."""
        fwd = sum(self.layer_fwd_flops_per_token(i) for i in range(self.cfg.n_layer))
        return 3 * (fwd + self.head_fwd_flops_per_token)


def _gpt3(n_layer: int, d_model: int, n_head: int, batch_seqs: int) -> dict:
    """Table 2.1's batch in tokens, as 2048-token sequences (0.5M -> 256, ..., 3.2M -> 1536)."""
    return dict(model=dict(vocab_size=50304, n_layer=n_layer, n_head=n_head, d_model=d_model,
                           max_seq_len=2048), seq_len=2048, global_batch=batch_seqs)


PRESETS: dict[str, dict] = {
    "gpt3-125m": _gpt3(12, 768, 12, 256),
    "gpt3-350m": _gpt3(24, 1024, 16, 256),
    "gpt3-760m": _gpt3(24, 1536, 16, 256),
    "gpt3-1.3b": _gpt3(24, 2048, 16, 512),
    "gpt3-2.7b": _gpt3(32, 2560, 32, 512),
    "gpt3-6.7b": _gpt3(32, 4096, 32, 1024),
    "gpt3-13b": _gpt3(40, 5120, 40, 1024),
    "gpt3-175b": _gpt3(96, 12288, 96, 1536),
    # MoE: Mixtral-8x7B's shape (Jiang et al. 2024): 8 experts, top-2, GQA 8 kv heads
    "mixtral-8x7b": dict(model=dict(vocab_size=32000, n_layer=32, n_head=32, n_kv_head=8, d_model=4096,
                                    d_ff=14336, max_seq_len=4096, n_experts=8, moe_top_k=2),
                         seq_len=4096, global_batch=1024),
    # DeepSpeed-MoE 1.3B+MoE-128 (Rajbhandari et al. 2022): experts in every other layer, top-1
    "gpt3-1.3b-moe128": dict(model=dict(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, max_seq_len=2048,
                                        n_experts=128, moe_every=2, moe_top_k=1),
                             seq_len=2048, global_batch=256),
    # Switch-style 350M base with 64 experts, every other layer, top-1
    "gpt3-350m-moe64": dict(model=dict(vocab_size=50304, n_layer=24, n_head=16, d_model=1024, max_seq_len=2048,
                                       n_experts=64, moe_every=2, moe_top_k=1),
                            seq_len=2048, global_batch=256),
}


def preset(name: str) -> ModelSpec:
    key = name.lower()
    if key not in PRESETS:
        raise ConfigError("--model", f"unknown model preset '{name}'; choose one of {sorted(PRESETS)}")
    p = PRESETS[key]
    return ModelSpec(key, ModelConfig(**p["model"]), p["seq_len"], p["global_batch"])


def from_config(cfg: ModelConfig, seq_len: int, global_batch: int, name: str = "recipe") -> ModelSpec:
    return ModelSpec(name, cfg, seq_len, global_batch)
