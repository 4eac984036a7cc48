"""Where tessel finds the parts of each Hugging Face family it knows, by module name: data, not code.

A Family says where the decoder layers live (recomputation, ZeRO-3 units, the
pipeline's cut) and, as the other axes land, how tensor parallelism splits the
family's modules, where a pipeline stage cuts it and how its experts map onto
tessel's dispatcher. A model of an unknown family still gets data parallelism,
ZeRO and recompute (its decoder layers are then its longest ModuleList).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from tessel.models.hf.tp_plan import GPT2_TP, LLAMA_TP, MIXTRAL_TP, TPRules


@dataclass(frozen=True)
class Family:
    name: str
    layers: str  # the ModuleList of decoder layers
    tp: TPRules | None = None  # how tensor parallelism splits it (tessel.models.hf.tp_plan)


FAMILIES = {
    "llama": Family("llama", layers="model.layers", tp=LLAMA_TP),  # also Mistral and Qwen2 (tessel.hf_shape.FAMILIES)
    "mixtral": Family("mixtral", layers="model.layers", tp=MIXTRAL_TP),
    "gpt2": Family("gpt2", layers="transformer.h", tp=GPT2_TP),
}


def decoder_layers(model: nn.Module, family: Family | None) -> list[nn.Module]:
    """The model's decoder layers, in order."""
    if family is not None:
        return list(model.get_submodule(family.layers))
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
