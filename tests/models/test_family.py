"""tessel.models.family: the answers the apply steps get are the ones they computed before the hooks existed."""

from tessel.config import ModelConfig
from tessel.models.build import build_model
from tessel.models.family import GPTFamily, HFFamily, model_family
from tessel.models.gpt import GPT, Block
from tessel.models.hf.families import decoder_layers, family_of, pipeline_parts, tp_rules
from tessel.models.hf.tp_plan import hf_tp_plan
from tessel.models.moe import MoE
from tessel.models.parts import GPT_PARTS
from tessel.models.plan import gpt_tp_plan

LLAMA = "recipes/hf/llama_tiny/config.json"


def test_the_reference_gpt_answers_with_its_own_plan_parts_and_blocks():
    cfg = ModelConfig(n_layer=3, n_experts=4, moe_every=2, d_model=32, n_head=2, vocab_size=64, max_seq_len=16)
    family, model = model_family(cfg), GPT(cfg)
    assert isinstance(family, GPTFamily) and not family.owns_loss and not family.experts_by_plan
    moe_blocks = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
    assert moe_blocks and family.tp_plan(model).styles == gpt_tp_plan(moe_blocks, 3)
    assert family.grid_tp_plan(model) == gpt_tp_plan([], 3)
    assert family.pipeline_parts(model) is GPT_PARTS and family.stage_sequence(GPT_PARTS) is None
    assert family.decoder_layers(model) == [m for m in model.modules() if isinstance(m, Block)]
    assert family.router_loss(model) is None and family.router_loss_spec(model) is None


def test_a_hugging_face_family_answers_from_its_plans():
    cfg = ModelConfig(hf_config=LLAMA)
    family, model = model_family(cfg), build_model(cfg)
    known = family_of("llama")
    assert isinstance(family, HFFamily) and family.family == known
    assert family.owns_loss and family.tp_places_all and family.transformers_attention and family.experts_by_plan
    assert family.tp_plan(model) == hf_tp_plan(model, tp_rules(model, known))
    assert family.pipeline_parts(model) == pipeline_parts(model, known)
    assert family.decoder_layers(model) == decoder_layers(model, known) and len(family.decoder_layers(model)) == 4
