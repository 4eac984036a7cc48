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

from tessel.models.parts import ModelParts


def has_pp_plan(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "base_model_pp_plan", None))


def parts_from_plan(model: nn.Module) -> ModelParts:
    """The pipeline parts of a transformers causal LM from its config's base_model_pp_plan; ValueError naming
    what the plan lacks where it does not describe an embedding, one list of layers and a head."""
    plan = dict(model.config.base_model_pp_plan or {})
    kind = type(model).__name__
    if not plan:
        raise ValueError(f"{kind}'s config declares no base_model_pp_plan (transformers' pipeline plan)")
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    names = list(plan)
    # getattr, not get_submodule: on a pipeline stage a part it does not hold is None
    lists = [n for n in names if isinstance(getattr(base, n, None), nn.ModuleList)]
    if len(lists) != 1:
        raise ValueError(f"{kind}'s base_model_pp_plan names {len(lists)} lists of layers ({lists}); a pipeline "
                         "cuts one")
    at = names.index(lists[0])
    before, after = names[:at], names[at + 1:]
    if not before or list(plan[before[0]][0]) != ["input_ids"]:
        raise ValueError(f"{kind}'s base_model_pp_plan starts with no part taking input_ids (its embedding)")
    head = head_name(model)
    stand_ins = {f"{prefix}.{n}": "pass" for n in (*before[1:], *after)} | {head: "pass"}
    return ModelParts(before=tuple(f"{prefix}.{n}" for n in before), blocks=f"{prefix}.{lists[0]}",
                      after=(*(f"{prefix}.{n}" for n in after), head),
                      tied=(f"{prefix}.{before[0]}.weight", f"{head}.weight"), stand_ins=stand_ins,
                      hidden_input=plan[before[0]][1][0], hand_over_at_blocks=True)


def head_name(model: nn.Module) -> str:
    """The module name of the causal LM's output head (its get_output_embeddings())."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    if name is None:
        raise ValueError(f"{type(model).__name__} has no output head (get_output_embeddings)")
    return name
