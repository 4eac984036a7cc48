"""The model as the planner sees it: its sizes, from a recipe (the reference GPT or a Hugging Face
config) or a preset.

The planner prices tessel's own model (RMSNorm, rotary attention with grouped
KV heads, SwiGLU MLP, optional MoE blocks), so a plan's `--out` recipe trains
exactly the model that was priced. A Hugging Face model's shape fills the same
fields (tessel.hf_shape); what its family does differently is an `Arch`: GPT-2's
two-matrix GELU MLP, LayerNorms with biases, biased projections and learned
positions, Qwen2's q/k/v biases, Llama's optional attention and MLP biases and
head_dim. Parameter counts then equal the built model's
(tests/planner/test_model_spec_hf.py). GPT-3 sizes follow Brown et al. 2020,
Table 2.1 (layers, d_model, heads, batch in tokens, 2048-token context); the
SwiGLU width ~8/3 d_model keeps the 8 d^2 MLP parameters of GPT-3's 4x GELU
MLP. The vocabulary is GPT-2's 50257 padded to 50304 (a multiple of 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tessel.config import ConfigError, ModelConfig
from tessel.hf_shape import read_config


@dataclass(frozen=True)
class Arch:
    """Where a family's blocks differ from the reference GPT's (whose values are the defaults)."""
    mlp_matrices: int = 3  # SwiGLU: gate, up, down; GPT-2's GELU MLP: fc, proj
    norm_params: int = 1  # per feature: RMSNorm's weight; LayerNorm's weight and bias
    qkv_bias: bool = False
    out_bias: bool = False  # the attention's output projection
    mlp_bias: bool = False
    positions: int = 0  # learned position embeddings (GPT-2's wpe)
    head_dim: int | None = None  # None: d_model / n_head


def architecture(cfg: ModelConfig) -> Arch:
    """The Arch of the model cfg names (read from its Hugging Face config, torch-free)."""
    if cfg.hf_config is None:
        return Arch()
    doc = read_config(cfg.hf_config)
    if doc["model_type"] == "gpt2":
        return Arch(mlp_matrices=2, norm_params=2, qkv_bias=True, out_bias=True, mlp_bias=True,
                    positions=cfg.max_seq_len)
    attention_bias = bool(doc.get("attention_bias", False))
    head_dim = doc.get("head_dim")
    return Arch(qkv_bias=attention_bias or doc["model_type"] == "qwen2", out_bias=attention_bias,
                mlp_bias=bool(doc.get("mlp_bias", False)), head_dim=head_dim if isinstance(head_dim, int) else None)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per step, the preset's (or recipe's) default

    @cached_property
    def arch(self) -> Arch:
        return architecture(self.cfg)

    # ---- parameter counts ----------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.arch.head_dim or self.cfg.d_model // self.cfg.n_head

    @property
    def attn_matrix_params(self) -> int:
        """q, k, v and output projections' weights (what a token is multiplied by)."""
        c = self.cfg
        return 2 * c.d_model * c.n_head * self.head_dim + 2 * c.d_model * c.kv_heads * self.head_dim

    @property
    def attn_params(self) -> int:
        c, a = self.cfg, self.arch
        qkv_bias = (c.n_head + 2 * c.kv_heads) * self.head_dim if a.qkv_bias else 0
        return self.attn_matrix_params + qkv_bias + (c.d_model if a.out_bias else 0)

    @property
    def mlp_matrix_params(self) -> int:
        return self.arch.mlp_matrices * self.cfg.d_model * self.cfg.ffn_dim

    @property
    def mlp_params(self) -> int:
        c, a = self.cfg, self.arch
        bias = (a.mlp_matrices - 1) * c.ffn_dim + c.d_model if a.mlp_bias else 0
        return self.mlp_matrix_params + bias

    @property
    def norm_params(self) -> int:
        """One norm's parameters."""
        return self.arch.norm_params * self.cfg.d_model

    def is_moe(self, layer: int) -> bool:
        c = self.cfg
        return c.n_experts > 0 and (layer + 1) % c.moe_every == 0

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.cfg.n_layer))

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(dense, expert) parameters of one block; norms count as dense."""
        c = self.cfg
        dense = self.attn_params + 2 * self.norm_params
        if self.is_moe(layer):
            return dense + c.d_model * c.n_experts, c.n_experts * self.mlp_params  # router is dense
        return dense + self.mlp_params, 0

    @property
    def embedding_params(self) -> int:
        """Token embeddings, and learned position embeddings where the family has them."""
        return (self.cfg.vocab_size + self.arch.positions) * self.cfg.d_model

    @property
    def head_params(self) -> int:
        """Final norm + output head (shared with the embedding when tied)."""
        c = self.cfg
        return self.norm_params + (0 if c.tie_embeddings else c.vocab_size * c.d_model)

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
        f = 2 * self.attn_matrix_params + 4 * self.seq_len * c.n_head * self.head_dim
        if self.is_moe(layer):
            pad = capacity_factor if capacity_factor is not None else 1.0
            f += 2 * c.d_model * c.n_experts + 2 * c.moe_top_k * pad * self.mlp_matrix_params
        else:
            f += 2 * self.mlp_matrix_params
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
