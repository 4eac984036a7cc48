"""tessel.hf.grid: what a tp grid places of a Hugging Face model, and the refusal naming the module and the
dimension where it cannot, before any process starts (on transformers' model built on the meta device)."""

import json

import pytest

from tessel.hf.grid import hf_grid_refusal
from tessel.commands.support import AXES, refusal
from tessel.commands.support import tiny_config as family_defaults
from tests.helpers import DERIVED, LATENT, PLANNED

# the families the grid's parity test trains (tests/parallel/tensor_nd/test_grid_modes.py)
ON_THE_GRID = ("qwen3", "gemma2", "phi3", "gpt_neox", "glm4")


@pytest.mark.parametrize("kind", ON_THE_GRID)
def test_the_families_the_grid_trains_are_accepted(kind):
    assert hf_grid_refusal({**PLANNED, **DERIVED}[kind], "2d", 2) is None


def test_what_the_grid_cannot_hold_is_named():
    # GPT-2 has rules of tessel's own, no plan the grid could read
    why = hf_grid_refusal(family_defaults("gpt2"), "2d", 2)
    assert "GPT2LMHeadModel's config declares no base_model_tp_plan" in why, why
    # the cube's linear layer takes no bias: the first biased projection is named
    why = hf_grid_refusal(PLANNED["gpt_neox"], "3d", 2)
    assert why.startswith("gpt_neox.layers.0.attention.query_key_value has a bias"), why
    # a bias in side^2 pieces: k_proj's 6 outputs (one kv head of 6) do not split in 4
    narrow = {**DERIVED["glm4"], "head_dim": 6, "num_key_value_heads": 1}
    assert hf_grid_refusal(narrow, "2d", 2) == ("model.layers.0.self_attn.k_proj.out_features (6) must be divisible "
                                               "by 4: the grid splits its bias in 4 pieces")
    # a side that does not divide a layer's input (3 x 3 grid, hidden 32)
    assert hf_grid_refusal(PLANNED["qwen3"], "2d", 3) == ("model.layers.0.self_attn.q_proj.in_features (32) must be "
                                                          "divisible by the grid's side 3")
    # latent attention's down projections run whole before the split by heads under 1D; the grid has no such
    # layer (it crashed on the hidden-split stream before this rule)
    for kind in LATENT:
        why = hf_grid_refusal(LATENT[kind], "2d", 2)
        assert why.startswith("the grid cannot place model.layers.0.self_attn.") and "latent attention" in why, why


def test_tessel_train_refuses_with_the_rule_in_one_line(tmp_path):
    """The recipe check (tessel.config.tp_grid_refusal) and the support matrix (tessel.commands.support.refusal)
    give it."""
    paths = {}
    for kind in ("gpt_neox", "qwen3_moe"):
        paths[kind] = tmp_path / f"{kind}.json"
        paths[kind].write_text(json.dumps({**PLANNED, **DERIVED}[kind]))
    why = refusal(str(paths["gpt_neox"]), ["parallel.tp=8", 'parallel.tp_mode="3d"'])
    assert why.startswith("model.hf_config: tp_mode '3d': model_type 'gpt_neox': gpt_neox.layers.0.attention."
                          "query_key_value has a bias"), why
    assert refusal(str(paths["gpt_neox"]), AXES["2D grid"]) is None
    # an MoE block is computed whole on every rank of the grid; its experts are not split over ep there
    assert refusal(str(paths["qwen3_moe"]), AXES["2D grid"]) is None
    why = refusal(str(paths["qwen3_moe"]), [*AXES["2D grid"], "parallel.ep=2"])
    assert why.startswith("parallel.ep: experts split over ep under tp_mode '2d' are not built yet"), why
