"""Where tessel finds the parts of each Hugging Face family it knows, by module name: data, not code.

A Family says where the decoder layers live (recomputation, ZeRO-3 units, the
pipeline's cut) and, as the other axes land, how tensor parallelism splits the
family's modules, where a pipeline stage cuts it (its ModelParts: the module
names of the embedding, the decoder layers, the final norm and head, what
stands in for each on a stage that does not hold it, and how a stage after the
first takes its hidden states) and how its experts map onto tessel's
dispatcher. A model of an unknown family still gets data parallelism,
ZeRO and recompute (its decoder layers are then its longest ModuleList).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tessel.models.hf.tp_plan import GPT2_TP, LLAMA_TP, MIXTRAL_TP, TPRules
from tessel.models.parts import ModelParts

# Llama, Mistral, Qwen2 and Mixtral (LlamaModel.forward and its copies): the embedding is skipped when
# inputs_embeds is given; the final norm and the head are always called, so they pass hidden states
# through before the last stage; the rotary embedding (buffers only) stays on every stage.
LLAMA_PARTS = ModelParts(
    before=("model.embed_tokens",), blocks="model.layers", after=("model.norm", "lm_head"),
    tied=("model.embed_tokens.weight", "lm_head.weight"),
    stand_ins={"model.norm": "pass", "lm_head": "pass"}, hidden_input="inputs_embeds")
# GPT-2 (GPT2Model.forward): hidden = inputs_embeds + wpe(positions), then dropout, so after the first
# stage the position embedding adds nothing and the dropout passes through (it ran on the first stage)
GPT2_PARTS = ModelParts(
    before=("transformer.wte", "transformer.wpe", "transformer.drop"), blocks="transformer.h",
    after=("transformer.ln_f", "lm_head"), tied=("transformer.wte.weight", "lm_head.weight"),
    stand_ins={"transformer.wpe": "zero", "transformer.drop": "pass", "transformer.ln_f": "pass", "lm_head": "pass"},
    hidden_input="inputs_embeds")


@dataclass(frozen=True)
class Family:
    name: str
    layers: str  # the ModuleList of decoder layers
    tp: TPRules | None = None  # how tensor parallelism splits it (tessel.models.hf.tp_plan)
    parts: ModelParts | None = None  # how a pipeline cuts it (tessel.models.parts)


FAMILIES = {
    # also Mistral and Qwen2 (tessel.hf_shape.FAMILIES)
    "llama": Family("llama", layers="model.layers", tp=LLAMA_TP, parts=LLAMA_PARTS),
    "mixtral": Family("mixtral", layers="model.layers", tp=MIXTRAL_TP, parts=LLAMA_PARTS),
    "gpt2": Family("gpt2", layers="transformer.h", tp=GPT2_TP, parts=GPT2_PARTS),
}


def decoder_layers(model: nn.Module, family: Family | None) -> list[nn.Module]:
    """The model's decoder layers, in order."""
    if family is not None:
        return list(model.get_submodule(family.layers))
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def pipeline_parts(model: nn.Module, family: Family | None) -> ModelParts:
    """The family's pipeline parts; for an architecture tessel has none for, ValueError naming the first
    module it could not place."""
    if family is not None and family.parts is not None:
        return family.parts
    first = next((f"{name} ({type(m).__name__})" for name, m in model.named_modules()
                  if any(True for _ in m.parameters(recurse=False))), type(model).__name__)
    raise ValueError(f"pipeline parallelism cannot place {first} of {type(model).__name__}: stages are cut by "
                     f"the module names of the families {', '.join(sorted(FAMILIES))}; this architecture trains "
                     "under dp, ZeRO and recompute")
