"""Where a pipeline cuts a Hugging Face causal LM, read from transformers' own plan: its base_model_pp_plan.

transformers declares, for most families, the base model's parts in the order
its forward runs them, each with its inputs and outputs:

    {"embed_tokens": (["input_ids"], ["inputs_embeds"]),
     "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
     "norm": (["hidden_states"], ["hidden_states"])}

(GPT-NeoX adds its embedding dropout, Phi its own). The causal LM's head
follows them (its class plan: {"lm_head": (["hidden_states"], ["logits"])}).
That is what tessel.models.parts.ModelParts says: the part taking the token ids
is the embedding, the one ModuleList the decoder layers, what comes before them
runs on the first stage, what comes after (and the head) on the last; a later
stage takes its hidden states by the embedding's output name (inputs_embeds),
which the model then uses in place of its token embedding.

What the model does between those parts, the plan does not say (Gemma's and
Granite's embedding multipliers, Gemma 2's final-logit soft-capping, Granite's
logits scaling), so stages hand over at the decoder layers themselves
(ModelParts.hand_over_at_blocks): a later stage's first layer takes what it
receives as it is, an earlier stage sends its last layer's output, and the
modules it does not hold stand in as pass-throughs whose output nothing reads.
"""

from __future__ import annotations

import torch.nn as nn

from tessel.hf.layout import pipeline_cut
from tessel.models.parts import ModelParts


def has_pp_plan(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "base_model_pp_plan", None))


def parts_from_plan(model: nn.Module) -> ModelParts:
    """The pipeline parts of a transformers causal LM from its config's base_model_pp_plan (tessel.hf.layout's
    cut, the one tessel.config checks before any process starts); ValueError naming what the plan lacks."""
    cut = pipeline_cut(model)
    head = cut.after[-1]
    stand_ins = {name: "pass" for name in (*cut.before[1:], *cut.after)}
    return ModelParts(before=cut.before, blocks=cut.blocks, after=cut.after,
                      tied=(f"{cut.before[0]}.weight", f"{head}.weight"), stand_ins=stand_ins,
                      hidden_input=cut.hidden_input, hand_over_at_blocks=True)
