"""How tensor parallelism splits a Hugging Face family: transformers' own plan, mapped onto tessel's.

transformers declares, for most families, which modules of the base model are
split and how: `config.base_model_tp_plan`, module patterns under the base
model ("layers.*.self_attn.q_proj" -> "colwise"). tessel reads it from the
model's own config and maps it onto its styles
(tessel.parallel.tensor.tensor_parallel.STYLES): colwise and rowwise; the
gathering variants (colwise_gather_output, then rowwise_split_input: OLMo 2's
q, k and v, whose norms span every head, and Phi-3's fused projections), after
which the module between them sees whole tensors; and
replicated_with_grad_allreduce (Qwen3's per-head q/k norms, which each rank
applies to its own heads: their gradients are summed over tp). Then it adds
what that plan leaves to transformers' runtime, from the model's structure and
its pipeline plan (tessel.models.hf.pp_plan):

- "enter" on the module around each group of column-parallel layers (the
  attention, the MLP): one Megatron f, or one sequence all-gather, shared by q,
  k and v, or by gate and up;
- the vocabulary-parallel embedding (the pipeline plan's part taking the token
  ids), whose output stays whole (the model reads its positions and causal
  mask from it), and the vocabulary-parallel head, whose logits stay split for
  tessel's vocab-parallel loss (transformers' "colwise_gather_output" would
  gather them); what the model does to them after the head (Gemma 2's
  soft-capping, Granite's scaling) is elementwise, so it is as right on a
  shard as on the whole;
- the norms of each decoder layer, outside the attention and the MLP, which
  run on sequence shards under sequence parallelism; the first decoder layer,
  where the sequence is split; and the final norm (the pipeline plan's part
  after the layers), whose output is the whole sequence again and enters the
  head's region;
- a module with weights inside a region the plan does not name (OLMo 2's q/k
  norms) is left whole where the region's projections gather their outputs
  (every rank computes it on the same whole tensor), and refused otherwise.

What a plan does not say, a family's notes (PlanNotes, in
tessel.models.hf.families) add, each checked against the plan: a fused
projection split block by block (Phi-3's qkv_proj, where the plan gathers it
whole). The derivation itself lives in tessel.hf.layout (tessel.config runs
it before any process starts): it also finds each MoE block (the module around
the experts the plans name as a whole) and has every tp rank compute it whole,
its experts going to the ep axis. A family without a plan at all (GPT-2) brings all
its rules here (GPT2_TP): its Conv1D layers (weight [in, out]) and its fused
q|k|v projection, split per head ("colwise_qkv"). This file must not import
tessel.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tessel.hf.layout import COLUMN, PlanNotes, TPRules, plan_styles, tp_cut
from tessel.hf.layout import rules_from_plan as derive_rules

GPT2_TP = TPRules(
    embedding="transformer.wte", first_layer="transformer.h.0",
    norms=("transformer.h.*.ln_1", "transformer.h.*.ln_2"), final_norm="transformer.ln_f",
    linear=(("transformer.h.*.attn.c_attn", "colwise_qkv"), ("transformer.h.*.attn.c_proj", "rowwise"),
            ("transformer.h.*.mlp.c_fc", "colwise"), ("transformer.h.*.mlp.c_proj", "rowwise")),
    kept=("transformer.wpe",),
    widths=(("transformer.h.*.attn", ("split_size",)),),  # it splits c_attn's output at the whole width
    reshapes_output=True)


@dataclass(frozen=True)
class TPPlan:
    """What tessel.parallel.tensor.tensor_parallel.apply_plan takes."""
    styles: dict[str, str]  # module pattern -> style
    widths: dict[str, tuple[str, ...]]  # module pattern -> attributes divided by tp
    blocks: dict[str, tuple[int, ...]]  # "colwise_packed" module pattern -> its blocks' relative sizes


def hf_tp_plan(model: nn.Module, rules: TPRules | None) -> TPPlan:
    """The plan for a transformers causal LM: its rules (rules_from_plan's, or GPT-2's own) as styles.

    rules None (an architecture tessel has no rules for): only what transformers' plan says, so that
    apply_plan(place_all=True) names the first module nobody placed.
    """
    if rules is None:
        linear = plan_styles(model, PlanNotes())
        return TPPlan({**{_parent(p): "enter" for p, s in linear.items() if s in COLUMN}, **linear}, {}, {})
    linear = dict(rules.linear)
    # first: the first pattern naming a module wins (apply_plan), and an MoE block is computed whole even where
    # a dense layer's MLP at the same place enters a region
    styles = {pattern: "replicate" for pattern in rules.replicated}
    styles.update({_parent(pattern): "enter" for pattern, style in linear.items() if style in COLUMN})
    styles.update({rules.embedding: "vocab_embedding_whole", rules.first_layer: "split_sequence"})
    styles.update({pattern: "sequence_norm" for pattern in rules.norms})
    styles[rules.final_norm] = "final_norm"
    styles.update({pattern: "keep" for pattern in rules.kept})
    styles.update(linear)
    styles[rules.head] = "vocab_head_entered"
    return TPPlan(styles, dict(rules.widths), dict(rules.blocks))


def rules_from_plan(model: nn.Module, notes: PlanNotes) -> TPRules:
    """A family's rules from its base_model_tp_plan, its pipeline plan's cut (or its structure's) and its modules
    (tessel.hf.layout, the derivation tessel.config's checks run too); ValueError naming what nothing places."""
    return derive_rules(model, tp_cut(model), notes)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]
