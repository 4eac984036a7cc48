"""The router loss tessel adds for a Hugging Face MoE is the family's own (tessel.models.hf.moe).

- the formula: tessel's balance loss, and its pipeline decomposition E * sum(C * S) / R^2, equal each installed
  family's load_balancing_loss_func on the same router logits;
- the logits: what tessel records during a training forward is, tensor for tensor, what the model itself
  returns as router_logits (its can_record_outputs: one router per layer, or JetMoE's two kinds);
- the terms: the coefficient, experts and top-k are the causal LM's own (its config class's defaults where the
  file says nothing), and a family whose forward adds no such loss (DeepSeek-V3) gets none.
The losses of whole training runs against transformers' are in tests/parallel/test_hf_dp_zero_recompute.py.
"""

import importlib

import pytest
import torch
from torch.testing import assert_close

from tessel.hf.config import transformers_config
from tessel.models.hf.moe import RouterLoss, balance_loss, balance_statistics, router_loss_spec

# transformers' MoE causal LMs that add a load-balancing loss (each module keeps its own copy of the function)
FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "granitemoe", "jetmoe", "gpt_oss", "dbrx",
            "minimax", "flex_olmo", "qwen3_next")
SMALL = {"vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 32}
MOE = {
    "qwen3_moe": {"head_dim": 8, "num_experts": 8, "num_experts_per_tok": 3, "moe_intermediate_size": 8},
    "jetmoe": {"num_key_value_heads": 2, "kv_channels": 8, "num_local_experts": 4, "num_experts_per_tok": 2},
    "gpt_oss": {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 4},
}


def _model(kind: str, **extra):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    config = transformers_config({"model_type": kind, **SMALL, **MOE.get(kind, {}), **extra})
    return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("kind", FAMILIES)
def test_the_balance_loss_is_the_familys_own(kind):
    own = importlib.import_module(f"transformers.models.{kind}.modeling_{kind}").load_balancing_loss_func
    gen = torch.Generator().manual_seed(0)
    for n_experts, top_k in ((8, 1), (8, 3), (16, 8)):
        logits = [torch.randn(40, n_experts, generator=gen) * 2 for _ in range(3)]  # 3 layers of 40 rows
        want = own(tuple(logits), n_experts, top_k)
        # float sums in another order (histc vs bincount, mean vs sum / R): ~1e-7 relative; a count or a
        # probability taken per layer, or over first choices only, moves it by > 1e-2
        assert_close(balance_loss(logits, n_experts, top_k), want, rtol=1e-6, atol=0)
        C, S, R = balance_statistics(logits, n_experts, top_k)
        assert_close(n_experts * (C * S).sum() / R ** 2, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("kind", list(MOE))
def test_the_logits_are_the_ones_the_model_returns(kind):
    model = _model(kind, output_router_logits=True)
    recorder = RouterLoss(model, router_loss_spec(model))
    out = model(input_ids=torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1)))
    recorded = recorder.take_logits()
    assert len(recorded) == len(out.router_logits) >= 2
    for got, want in zip(recorded, out.router_logits):
        assert got is want  # the very tensors transformers collects, in its order


def test_the_terms_are_the_models_own():
    qwen = router_loss_spec(_model("qwen3_moe", output_router_logits=True))
    # the file names no coefficient: Qwen3MoeConfig's default, as transformers adds it
    assert (qwen.coef, qwen.n_experts, qwen.top_k) == (0.001, 8, 3)
    assert router_loss_spec(_model("jetmoe", output_router_logits=True, aux_loss_coef=0.3)).coef == 0.3
    assert router_loss_spec(_model("qwen3_moe")) is None  # output_router_logits off: transformers adds nothing
    deepseek = _model("deepseek_v3", output_router_logits=True, n_routed_experts=4, num_experts_per_tok=2,
                      n_group=1, topk_group=1, moe_intermediate_size=8, kv_lora_rank=8, q_lora_rank=8,
                      qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
    assert router_loss_spec(deepseek) is None  # it records router logits but balances by a bias, no loss
