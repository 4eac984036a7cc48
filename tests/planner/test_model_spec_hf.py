"""The planner's ModelSpec of a Hugging Face model counts what transformers builds: parameters equal the
built model's, FLOPs per token the runtime's MFU numerator (tessel.models.flops)."""

from __future__ import annotations

import json

import pytest
import torch

from tessel.config import ModelConfig
from tessel.models.build import build_model
from tessel.models.flops import training_flops_per_token
from tessel.models.gpt import count_params
from tessel.planner.fit import param_count
from tessel.planner.model_spec import from_config

BASE = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 32}
CONFIGS = {
    "llama": {"model_type": "llama", **BASE},
    "llama-biases-head_dim-tied": {"model_type": "llama", **BASE, "attention_bias": True, "mlp_bias": True,
                                   "head_dim": 16, "tie_word_embeddings": True},
    "mistral": {"model_type": "mistral", **BASE},
    "qwen2": {"model_type": "qwen2", **BASE},  # q, k, v biases
    "gpt2": {"model_type": "gpt2", "vocab_size": 96, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 32},
    "mixtral": {"model_type": "mixtral", **BASE, "num_local_experts": 4, "num_experts_per_tok": 2},
    # experts beside dense layers, shared experts and multi-head latent attention (tessel.hf.blocks)
    "qwen3_moe-sparse-step": {"model_type": "qwen3_moe", **BASE, "num_experts": 4, "num_experts_per_tok": 2,
                              "moe_intermediate_size": 16, "decoder_sparse_step": 2, "head_dim": 8},
    "qwen2_moe-shared": {"model_type": "qwen2_moe", **BASE, "num_experts": 4, "num_experts_per_tok": 2,
                         "moe_intermediate_size": 16, "shared_expert_intermediate_size": 48},
    "deepseek_v3": {"model_type": "deepseek_v3", **BASE, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "n_group": 1, "topk_group": 1, "moe_intermediate_size": 16, "n_shared_experts": 1,
                    "first_k_dense_replace": 1, "q_lora_rank": 16, "kv_lora_rank": 8, "qk_rope_head_dim": 4,
                    "qk_nope_head_dim": 8, "v_head_dim": 8, "num_key_value_heads": 4},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_spec_counts_what_transformers_builds(name, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIGS[name]))
    m = ModelConfig(hf_config=str(path))
    with torch.device("meta"):
        model = build_model(m)
    spec = from_config(m, 16, 8)
    assert spec.total_params == param_count(spec) == count_params(model)
    assert spec.model_flops_per_token() == training_flops_per_token(model, m, 16)


def test_recipe_llama_tiny_is_planned_as_built():
    from tessel.config import load_config
    cfg = load_config("recipes/llama_tiny.toml")
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch).total_params == count_params(model)
