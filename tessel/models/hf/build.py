"""A Hugging Face causal LM built from its local config, unmodified, as tessel trains it.

The model is transformers' own class (AutoModelForCausalLM.from_config): no
layer of it is rewritten. One forward hook makes it answer like the reference
GPT, token ids -> logits (B, T, V), so every runner, loss and sampler works on
it unchanged; the hook changes no parameter name, so checkpoints keep the
model's own names (what `from_pretrained` expects).

Nothing reaches the network: HF_HUB_OFFLINE is set before transformers loads,
and configs and weights come from local paths only.
"""

from __future__ import annotations

import os

import torch.nn as nn

from tessel.hf_shape import read_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_hf(hf_config: str) -> nn.Module:
    """transformers' model for the config at `hf_config` (a config.json or its folder), on the current device."""
    # deferred: transformers takes seconds to import; only recipes naming a Hugging Face model pay for it
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()  # its warnings about unused generation ids are not the user's concern here
    doc = read_config(hf_config)
    config = AutoConfig.for_model(doc.pop("model_type"), **doc)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=_attention(config))
    answer_with_logits(model)
    return model


def _attention(config) -> str:
    """SDPA where the family's class takes it; its eager attention where it refuses SDPA (Gemma 2, whose
    attention soft-caps its scores)."""
    from transformers import AutoModelForCausalLM  # deferred: transformers takes seconds to import
    cls = AutoModelForCausalLM._model_mapping[type(config)]
    return "sdpa" if getattr(cls, "_supports_sdpa", True) else "eager"


def answer_with_logits(model: nn.Module) -> None:
    """Make a transformers causal LM's forward return its logits tensor (B, T, V), as tessel's runners, losses
    and pipeline stages take it (a second hook finds a tensor and passes it on)."""
    model.register_forward_hook(_logits_only)


def _logits_only(module: nn.Module, args, output):
    """transformers' ModelOutput -> its logits: what tessel's losses and samplers take."""
    logits = output.get("logits") if isinstance(output, dict) else None
    return output if logits is None else logits
