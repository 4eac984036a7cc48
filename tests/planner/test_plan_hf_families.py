"""`tessel plan` on Hugging Face families (issue 31, defect 5): it prices the model transformers builds (experts,
shared experts, first dense layers, latent attention) and offers only the layouts `tessel train` accepts for
the recipe. Configs come from the families' own config classes; the large ones are counted, never built.

The tests' numbers are the families' published sizes (DeepSeek-V3: 671B parameters, 37B activated per token,
DeepSeek-AI 2024, Table 1 of the report) and tessel.config's own verdicts, not the planner's output."""

from __future__ import annotations

import json
import math

import pytest
from transformers import DeepseekV3Config, LlamaConfig, MixtralConfig, Qwen3Config, Qwen3MoeConfig

from tessel.config import ConfigError, build_config
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout, layout_config
from tessel.planner.model_spec import from_config
from tessel.planner.search import search
from tessel.commands.planning import recipe_allows

GiB = 2**30
# Qwen3-32B's shape (its config.json on the Hub: 64 layers, d 5120, 64 query and 8 kv heads of 128)
QWEN3_32B = dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=40960)
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, bos_token_id=1, eos_token_id=2)


def _recipe(tmp_path, config, **train) -> dict:
    """A recipe training `config` (a transformers config object), written beside the test."""
    path = tmp_path / f"{config.model_type}.json"
    path.write_text(config.to_json_string())
    return {"model": {"hf_config": str(path)}, "data": {"source": "synthetic"},
            "train": {"precision": "bf16", "warmup_steps": 0, **train}}


def _search(recipe: dict, world: int, **fixed):
    """What `tessel plan` prices for the recipe on `world` A100s (tessel.commands.planning.plan's search, its
    filter)."""
    base = build_config(recipe)
    spec = from_config(base.model, base.train.seq_len, base.train.global_batch)
    cm = CostModel(spec, get_cluster("a100", world), base.train.precision)
    return base, search(cm, world, base.train.global_batch, fixed or None, simulate_top=0, allow=recipe_allows(base))


def _refusals(base, estimates) -> list[str]:
    """Each printed layout that `tessel train` would refuse, with tessel.config's reason."""
    out = []
    for est in estimates:
        try:
            layout_config(base, est.layout)
        except ConfigError as err:
            out.append(f"{est.layout.describe()}: {err}")
    return out


def test_qwen3_32b_plan_offers_only_layouts_tessel_train_accepts(tmp_path):
    # was: dp4 tp2 zero3 sp recompute on 8 A100s, which tessel train refuses (no tp for qwen3), and --out exited 2
    recipe = _recipe(tmp_path, Qwen3Config(**QWEN3_32B), seq_len=4096, global_batch=64)
    base, result = _search(recipe, 16)
    assert result.ranked, "some layout of 16 A100s fits a 32B model under ZeRO-3"
    assert _refusals(base, result.ranked + result.rejected) == []  # the ranked table and the out-of-memory lines
    assert all(e.layout.recompute != "selective" for e in result.ranked + result.rejected)


def test_selective_recompute_is_never_offered_for_a_hugging_face_model(tmp_path):
    base = build_config(_recipe(tmp_path, LlamaConfig(**TINY), seq_len=64, global_batch=8))
    rules = recipe_allows(base)
    # tessel.config: 'full' or 'none' for HF models
    assert not rules(Layout(dp=1, micro_batch=8, recompute="selective"))
    assert rules(Layout(dp=1, micro_batch=8, recompute="full"))
    assert "parallel.recompute" in " ".join(rules.refusals())


def test_deepseek_v3_is_planned_as_its_671b_experts(tmp_path):
    # was: 40.4B dense parameters, 68.9 GiB per device on dp64 ZeRO-3, MFU over all experts instead of 8 of 256
    recipe = _recipe(tmp_path, DeepseekV3Config(), seq_len=4096, global_batch=512)
    base = build_config(recipe)
    spec = from_config(base.model, 4096, 512)
    assert 671e9 <= spec.total_params < 672e9  # the report's 671B
    active = sum(b.matmul_params_per_token for b in spec.blocks)  # the weights one token multiplies
    assert 36e9 <= active + spec.cfg.vocab_size * spec.cfg.d_model <= 38e9  # "37B activated" (with the head)
    attention = 12 * 4096 * spec.cfg.n_layer * spec.attention.heads * (192 + 128) / 2  # qk 128+64, v 128
    assert spec.model_flops_per_token() == pytest.approx(6 * (active + spec.cfg.vocab_size * 7168) + attention)
    est = CostModel(spec, get_cluster("a100", 64), "bf16").estimate(Layout(dp=64, zero_stage=3, micro_batch=1,
                                                                           grad_accum=8, recompute="full"))
    state = est.memory["params"] + est.memory["optimizer"]  # fp32 weights and AdamW's two moments, over 64
    assert state == pytest.approx(12 * spec.total_params / 64)
    assert state / GiB > 117 and not est.fits  # so it cannot be planned on 64 A100s at all


@pytest.mark.parametrize("name", ["llama", "mixtral", "qwen3", "qwen3_moe", "deepseek_v3"])
def test_every_layout_a_plan_prints_is_one_tessel_train_accepts(tmp_path, name):
    config = {"llama": LlamaConfig(**TINY), "mixtral": MixtralConfig(**TINY, num_local_experts=4),
              "qwen3": Qwen3Config(**TINY), "qwen3_moe": Qwen3MoeConfig(**TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
              "deepseek_v3": DeepseekV3Config(**{**TINY, "head_dim": None}, n_routed_experts=4, n_group=1, topk_group=1,
                                              moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32,
                                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
                                              v_head_dim=16)}[name]
    base, result = _search(_recipe(tmp_path, config, seq_len=64, global_batch=8), 4)
    printed = result.ranked + result.rejected
    assert printed and _refusals(base, printed) == []
    assert all(math.isfinite(e.step_s) for e in printed)


def test_plan_out_writes_a_recipe_tessel_train_loads(tmp_path):
    from rich.console import Console

    from tessel.config import load_config
    from tessel.commands.planning import PlanOptions, plan, resolve
    recipe = tmp_path / "qwen3.toml"
    doc = _recipe(tmp_path, Qwen3Config(**TINY), seq_len=64, global_batch=8)
    recipe.write_text(f'[model]\nhf_config = "{doc["model"]["hf_config"]}"\n[data]\nsource = "synthetic"\n'
                      '[train]\nseq_len = 64\nglobal_batch = 8\nwarmup_steps = 0\n')
    out = tmp_path / "planned.toml"
    prob = resolve(str(recipe), [], "a100", 4, None, None, None)
    report = plan(prob, PlanOptions(top=3, out=str(out)), console=Console(file=open(tmp_path / "log", "w")))
    cfg = load_config(out)  # what `tessel train planned.toml` runs first: every rule, exit 2 on any
    assert cfg.parallel.world_size == 4 and report["recipe"] == str(out)
    assert json.loads(json.dumps(report["plans"]))[0]["layout"]["tp"] == cfg.parallel.tp


def test_latent_attention_down_projections_are_priced_whole_on_every_tp_rank(tmp_path):
    """tessel runs DeepSeek-V3's q_a_proj, kv_a_proj_with_mqa and their norms whole on every tp rank (before the
    split by heads, tessel.hf.region_inputs): the planner counts them once per rank, the rest of the dense
    weights split over tp."""
    spec = from_config(build_config(_recipe(tmp_path, DeepseekV3Config(), seq_len=4096, global_batch=512)).model,
                       4096, 512)
    whole = 7168 * 1536 + 7168 * (512 + 64) + 1536 + 512  # q_a_proj, kv_a_proj_with_mqa, q_a/kv_a_layernorm
    assert spec.layer_tp_whole_params(0) == whole
    model = CostModel(spec, get_cluster("a100", 64), "bf16")
    params = {tp: model.estimate(Layout(dp=64 // tp, tp=tp, zero_stage=0, micro_batch=1, grad_accum=8,
                                        recompute="full")).memory["params"]
              for tp in (1, 2)}
    dense = sum(spec.layer_params(i)[0] for i in range(spec.cfg.n_layer)) + spec.embedding_params + spec.head_params
    # the latent projections of every layer, and each MoE block's router and shared experts (the block runs whole
    # on every tp rank, as tessel's layouts run it)
    kept = sum(spec.layer_tp_whole_params(i) for i in range(spec.cfg.n_layer))
    assert kept > whole * spec.cfg.n_layer  # the MoE blocks' router and shared experts are among them
    # fp32 parameters: the dense part halves but for what every rank keeps whole; the routed experts, split over
    # ep only, do not change with tp
    assert params[1] - params[2] == pytest.approx(4 * (dense - kept) / 2)
