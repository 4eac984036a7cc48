"""The MFU numerator counted from the model's own weights (tessel.models.flops): the reference GPT's
formula for the reference GPT, and each Hugging Face family's own shape (GPT-2's two-matrix MLP,
Mixtral's active experts)."""

from __future__ import annotations

import json

import pytest
import torch

from tessel.config import ModelConfig
from tessel.models.build import build_model
from tessel.models.flops import training_flops_per_token
from tessel.models.gpt import flops_per_token

T = 16


def meta(m: ModelConfig):
    with torch.device("meta"):
        return build_model(m)


@pytest.mark.parametrize("shape", [dict(), dict(tie_embeddings=True), dict(n_kv_head=2, d_ff=100),
                                   dict(n_layer=4, n_experts=4, moe_every=2, moe_top_k=2)],
                         ids=["dense", "tied", "gqa", "moe"])
def test_reference_gpt_matches_its_formula(shape):
    m = ModelConfig(**shape)
    assert training_flops_per_token(meta(m), m, T) == flops_per_token(m, T)


def test_a_sliding_window_counts_the_keys_in_its_band():
    """Attention FLOPs over the keys a query sees: the window where it is shorter than the sequence (the
    kernel skips the blocks outside the band), the whole sequence where it is not."""
    plain, narrow, wide = ModelConfig(), ModelConfig(sliding_window=4), ModelConfig(sliding_window=4 * T)
    attention = 12 * plain.n_layer * plain.d_model
    assert training_flops_per_token(meta(plain), plain, T) - flops_per_token(narrow, T) == attention * (T - 4)
    assert training_flops_per_token(meta(narrow), narrow, T) == flops_per_token(narrow, T)
    assert flops_per_token(wide, T) == flops_per_token(plain, T)


def hf(tmp_path, doc: dict) -> ModelConfig:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(doc))
    return ModelConfig(hf_config=str(path))


def test_gpt2_counts_its_gelu_mlp_and_tied_head(tmp_path):
    d, L, V, P = 32, 2, 96, 32
    m = hf(tmp_path, {"model_type": "gpt2", "vocab_size": V, "n_embd": d, "n_layer": L, "n_head": 4, "n_positions": P})
    # per layer c_attn (d x 3d), c_proj (d x d), c_fc (d x 4d), mlp c_proj (4d x d); the head is the tied
    # token embedding (counted once); position embeddings are a lookup
    matmul = L * (3 * d * d + d * d + 2 * 4 * d * d) + V * d
    assert training_flops_per_token(meta(m), m, T) == 6 * matmul + 12 * L * d * T
    assert training_flops_per_token(meta(m), m, T) != flops_per_token(m, T)  # not a SwiGLU


def test_mixtral_counts_the_experts_a_token_visits(tmp_path):
    d, L, V, F, E, k = 32, 2, 96, 64, 4, 2
    m = hf(tmp_path, {"model_type": "mixtral", "vocab_size": V, "hidden_size": d, "intermediate_size": F,
                      "num_hidden_layers": L, "num_attention_heads": 4, "num_key_value_heads": 2,
                      "max_position_embeddings": 32, "num_local_experts": E, "num_experts_per_tok": k})
    attn = d * d * 2 + d * (d // 2) * 2  # q, o; k, v with 2 of 4 heads
    matmul = L * (attn + d * E + k * 3 * d * F) + V * d  # router whole, top-k experts, untied head
    assert training_flops_per_token(meta(m), m, T) == 6 * matmul + 12 * L * d * T
