"""The model as the planner sees it: its blocks and sizes, from a recipe (the reference GPT or a Hugging Face
config) or a preset.

The planner prices a model block by block: each block's attention projections, its feed-forward or its
experts (routed, shared, the router), its norms (tessel.hf.blocks). tessel's own GPT (RMSNorm, rotary
attention with grouped KV heads, SwiGLU MLP, optional MoE blocks) is written here in those terms, so a
plan's `--out` recipe trains exactly the model that was priced; a Hugging Face model's blocks are read from
its config as transformers builds them (tessel.hf.blocks: GPT-2's two-matrix GELU MLP and learned positions,
biases, q/k norms, fused projections, multi-head latent attention, shared experts and first dense layers),
so parameter counts equal the built model's (tests/planner/test_model_spec_hf.py,
tests/hf/test_hf_blocks.py). GPT-3 sizes follow Brown et al. 2020, Table 2.1 (layers, d_model, heads, batch
in tokens, 2048-token context); the SwiGLU width ~8/3 d_model keeps the 8 d^2 MLP parameters of GPT-3's 4x
GELU MLP. The vocabulary is GPT-2's 50257 padded to 50304 (a multiple of 128).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from tessel.config import ConfigError, ModelConfig
from tessel.hf.blocks import Attention, Block, Experts, FeedForward, ModelBlocks, read_model
from tessel.hf.shape import read_config


def reference_blocks(c: ModelConfig) -> ModelBlocks:
    """tessel's GPT (tessel.models.gpt) as blocks: every moe_every-th block an MoE block when n_experts > 0."""
    d, hd = c.d_model, c.d_model // c.n_head
    q, kv = c.n_head * hd, c.kv_heads * hd
    attention = Attention(((d, q, "out"), (d, kv, "out"), (d, kv, "out"), (q, d, "in")), 0, c.n_head, c.kv_heads,
                          hd, hd)
    mlp = FeedForward(d, c.ffn_dim, 3, 0)
    shared = FeedForward(d, c.n_shared_experts * c.ffn_dim, 3, 0) if c.n_shared_experts else None
    moe = Block(attention, 2 * d, experts=Experts(c.n_experts, c.moe_top_k, mlp, d * c.n_experts, shared))
    dense = Block(attention, 2 * d, mlp=mlp)
    blocks = tuple(moe if c.n_experts and (i + 1) % c.moe_every == 0 else dense for i in range(c.n_layer))
    return ModelBlocks("gpt", d, c.vocab_size, blocks, c.vocab_size * d, d, 0 if c.tie_embeddings else c.vocab_size * d,
                       exact=True)


def model_blocks(c: ModelConfig) -> ModelBlocks:
    """The blocks of the model `c` names: transformers' (read from its config, torch-free) or tessel's GPT."""
    return read_model(read_config(c.hf_config)) if c.hf_config is not None else reference_blocks(c)


@dataclass(frozen=True)
class ModelSpec:
    name: str
    cfg: ModelConfig
    seq_len: int
    global_batch: int  # sequences per step, the preset's (or recipe's) default

    @cached_property
    def model(self) -> ModelBlocks:
        return model_blocks(self.cfg)

    @property
    def blocks(self) -> tuple[Block, ...]:
        return self.model.blocks

    # ---- shapes the cost model prices ------------------------------------------
    @property
    def attention(self) -> Attention:
        return self.blocks[0].attention

    @property
    def head_dim(self) -> float:
        """A head's width in the attention core: a query/key head's and a value head's mean (equal, but under
        multi-head latent attention), so heads x head_dim x 4 T is the core's forward FLOPs per token."""
        a = self.attention
        return a.qk_dim if a.qk_dim == a.v_dim else (a.qk_dim + a.v_dim) / 2

    @property
    def feed_forward(self) -> FeedForward:
        """A dense block's feed-forward (an expert's in a model of MoE blocks only)."""
        return next((b.mlp for b in self.blocks if b.mlp is not None), None) or self.experts.expert

    @property
    def mlp_matrices(self) -> int:
        return self.feed_forward.matrices  # SwiGLU: gate, up, down; GPT-2's GELU MLP: fc, proj

    @property
    def experts(self) -> Experts | None:
        """The experts of the MoE blocks (every MoE block of a model has the same), None for a dense model."""
        return next((b.experts for b in self.blocks if b.experts is not None), None)

    @property
    def n_experts(self) -> int:
        return self.experts.count if self.experts else 0

    @property
    def moe_top_k(self) -> int:
        return self.experts.top_k if self.experts else self.cfg.moe_top_k

    @property
    def expert_ffn(self) -> int:
        """One routed expert's hidden width (DeepSeek's and Qwen-MoE's moe_intermediate_size)."""
        return self.experts.expert.width if self.experts else self.cfg.ffn_dim

    @property
    def shared_ffn(self) -> int:
        """The width of the shared experts every token of an MoE block passes through (0: none)."""
        shared = self.experts.shared if self.experts else None
        return shared.width if shared else 0

    # ---- parameter counts ----------------------------------------------------
    @property
    def attn_matrix_params(self) -> int:
        """The attention's weights a token is multiplied by (q, k, v and output; latent attention's pairs)."""
        return self.attention.matrix_params

    @property
    def mlp_matrix_params(self) -> int:
        return self.feed_forward.matrix_params

    def is_moe(self, layer: int) -> bool:
        return self.blocks[layer].experts is not None

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.cfg.n_layer))

    def layer_params(self, layer: int) -> tuple[int, int]:
        """(dense, expert) parameters of one block; norms, the router and shared experts count as dense."""
        return self.blocks[layer].params

    def layer_tp_whole_params(self, layer: int) -> int:
        """The part of layer_params' dense count every tp rank holds whole: latent attention's down projections,
        and an MoE block's router and shared experts (the block runs whole on every tp rank: the reference GPT's
        plan replicates it, and tessel computes a Hugging Face sparse block whole, tessel.hf.layout)."""
        block = self.blocks[layer]
        return block.attention.tp_whole_params + (block.experts.dense_params if block.experts else 0)

    @property
    def embedding_params(self) -> int:
        """Token embeddings, and learned position embeddings where the family has them."""
        return self.model.embedding

    @property
    def head_params(self) -> int:
        """Final norm + output head (shared with the embedding when tied)."""
        return self.model.final_norm + self.model.head

    @property
    def total_params(self) -> int:
        return self.model.total_params

    # ---- FLOPs per token ----------------------------------------------------
    def layer_fwd_flops_per_token(self, layer: int, capacity_factor: float | None = None) -> float:
        """Forward FLOPs of one block per token: 2 per matmul weight + causal attention.

        Attention scores and the weighted sum cost 2 * 2 * T * d (Kaplan et al.
        2020, counted without the causal halving, as tessel.models.gpt does).
        An MoE block computes top_k experts per token (and its shared experts), the top_k padded to the
        capacity factor when given (fixed-capacity dispatch computes the padding too).
        """
        block = self.blocks[layer]
        f = 2 * block.matmul_params_per_token + 4 * self.seq_len * self.attention.heads * self.head_dim
        if block.experts is not None and capacity_factor is not None:
            e = block.experts
            f += 2 * e.top_k * (capacity_factor - 1) * e.expert.matrix_params
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
