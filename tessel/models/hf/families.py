"""What tessel knows of each Hugging Face family beyond transformers' own plans: data, not code.

A family whose config declares a base_model_pp_plan and a base_model_tp_plan
needs nothing here, not even its name (family_of): its decoder layers, its
pipeline cut and its tensor-parallel rules, MoE blocks included (computed whole
on every tp rank, their experts on the ep axis), are derived from those plans
and from the model's own modules (tessel.hf.layout), or refused naming what the
derivation cannot place. FAMILIES lists the families whose parity tests predate
that derivation (tessel.hf.shape.FAMILIES, the checks' fast path), and keeps
notes only for what a plan does not say (PlanNotes, each checked against the
plan): Phi-3's fused projections, split block by block where its plan gathers
them. A family with no plans at all (GPT-2) brings all of its rules and parts.
A model without plans still gets data parallelism, ZeRO and recompute (its
decoder layers are then its longest ModuleList).

Which model types tessel places on which axis is checked before any process
starts by tessel.config (tessel.hf.shape reads the config's JSON;
tessel.hf.layout runs the derivation on the model built on the meta device).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tessel.models.hf.pp_plan import has_pp_plan, parts_from_plan
from tessel.models.hf.tp_plan import GPT2_TP, PlanNotes, TPRules, rules_from_plan
from tessel.models.parts import ModelParts

# GPT-2 (GPT2Model.forward): hidden = inputs_embeds + wpe(positions), then dropout, so after the first
# stage the position embedding adds nothing and the dropout passes through (it ran on the first stage)
GPT2_PARTS = ModelParts(
    before=("transformer.wte", "transformer.wpe", "transformer.drop"), blocks="transformer.h",
    after=("transformer.ln_f", "lm_head"), tied=("transformer.wte.weight", "lm_head.weight"),
    stand_ins={"transformer.wpe": "zero", "transformer.drop": "pass", "transformer.ln_f": "pass", "lm_head": "pass"},
    hidden_input="inputs_embeds")

# Phi-3 packs q|k|v (num_attention_heads, then num_key_value_heads twice, of head_dim each) and gate|up
# into one projection each; its plan gathers their outputs whole, so every rank would compute every head.
# Split block by block instead, each rank holds the q, k, v of its own heads and its half of gate and up;
# its attention finds q at config.num_attention_heads * head_dim and k after it at num_key_value_heads *
# head_dim, so both become the rank's own counts (the model's config keeps the whole ones)
PHI3_NOTES = PlanNotes(
    linear=(("layers.*.self_attn.qkv_proj", "colwise_packed"), ("layers.*.self_attn.o_proj", "rowwise"),
            ("layers.*.mlp.gate_up_proj", "colwise_packed"), ("layers.*.mlp.down_proj", "rowwise")),
    blocks=(("layers.*.self_attn.qkv_proj", ("num_attention_heads", "num_key_value_heads", "num_key_value_heads")),
            ("layers.*.mlp.gate_up_proj", (1, 1))),
    widths=(("layers.*.self_attn", ("num_key_value_heads", "config.num_attention_heads")),))


@dataclass(frozen=True)
class Family:
    name: str
    notes: PlanNotes = PlanNotes()  # what its plans do not say
    tp: TPRules | None = None  # a family without plans: its own tensor-parallel rules
    parts: ModelParts | None = None  # and its own pipeline cut


FAMILIES = {name: Family(name) for name in (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "gpt_neox",
    "starcoder2", "cohere", "mixtral")} | {
    "phi3": Family("phi3", notes=PHI3_NOTES),
    "gpt2": Family("gpt2", tp=GPT2_TP, parts=GPT2_PARTS),
}


def family_of(model_type: str) -> Family:
    """The family's entry here, or for a model type without one, a family placed from its own plans alone
    (tessel.hf.layout derives its cut and its rules, or refuses it naming what it cannot place)."""
    return FAMILIES.get(model_type) or Family(model_type)


def pipeline_parts(model: nn.Module, family: Family | None) -> ModelParts:
    """The family's pipeline parts (its own, or read from the model's pipeline plan); for an architecture
    tessel has none for, ValueError naming the first module it could not place."""
    if family is not None and family.parts is not None:
        return family.parts
    if family is not None and has_pp_plan(model):
        return parts_from_plan(model)
    first = next((f"{name} ({type(m).__name__})" for name, m in model.named_modules()
                  if any(True for _ in m.parameters(recurse=False))), type(model).__name__)
    raise ValueError(f"pipeline parallelism cannot place {first} of {type(model).__name__}: stages are cut by "
                     f"the module names of the families {', '.join(sorted(FAMILIES))}; this architecture trains "
                     "under dp, ZeRO and recompute")


def tp_rules(model: nn.Module, family: Family | None) -> TPRules | None:
    """The family's tensor-parallel rules (its own, or read from the model's plans); None for an architecture
    tessel has none for (tessel.models.hf.tp_plan.hf_tp_plan then names what nothing places)."""
    if family is None:
        return None
    if family.tp is not None:
        return family.tp
    return rules_from_plan(model, family.notes)


def decoder_layers(model: nn.Module, family: Family | None) -> list[nn.Module]:
    """The model's decoder layers, in order (on a pipeline stage: the ones it holds)."""
    if family is not None and (family.parts is not None or has_pp_plan(model)):
        try:
            return pipeline_parts(model, family).held_blocks(model)
        except ValueError:  # a plan that cannot cut stages (weights beside its parts) still names no other layers
            pass
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
