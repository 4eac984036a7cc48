"""A Hugging Face causal LM built from its local config, unmodified, as tessel trains it.

The model is transformers' own class (AutoModelForCausalLM.from_config): no
layer of it is rewritten. Its attention is the implementation transformers
itself picks when none is asked for: SDPA where the class supports it, its own
eager attention otherwise (Gemma 2, whose soft-capping SDPA cannot do). Two hooks
make it train as tessel trains every model (as_training_model, for a model built
here and one handed to tessel.parallelize alike): its forward answers like the
reference GPT, token ids -> logits (B, T, V), so every runner, loss and sampler
works on it unchanged, and it never builds a key/value cache. The hooks change no
parameter name, so checkpoints keep the model's own names (what `from_pretrained`
expects).

Nothing reaches the network: HF_HUB_OFFLINE is set before transformers loads,
and configs and weights come from local paths only.
"""

from __future__ import annotations

import os

import torch.nn as nn

from tessel.hf.config import transformers_config
from tessel.hf.shape import read_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def build_hf(hf_config: str) -> nn.Module:
    """transformers' model for the config at `hf_config` (a config.json or its folder), on the current device."""
    # deferred: transformers takes seconds to import; only recipes naming a Hugging Face model pay for it
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    logging.set_verbosity_error()  # its warnings about unused generation ids are not the user's concern here
    doc = read_config(hf_config)
    config = transformers_config(doc)
    attention = attention_implementation(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)])
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention)
    as_training_model(model)
    return model


def attention_implementation(model_class: type) -> str:
    """The attention transformers gives `model_class` when none is asked for (PreTrainedModel.
    get_correct_attn_implementation): SDPA where the class declares it (_supports_sdpa), its eager attention
    otherwise. Named explicitly, so that an `attn_implementation` saved in a config.json (flash attention, a hub
    kernel) does not decide it; FlexAttention, which some classes offer instead, has no backward on the CPU."""
    return "sdpa" if model_class._supports_sdpa else "eager"


def as_training_model(model: nn.Module) -> None:
    """How tessel runs every transformers causal LM it trains: its forward returns its logits tensor (B, T, V),
    as tessel's runners, losses and pipeline stages take it, and never builds a key/value cache."""
    without_kv_cache(model)
    model.register_forward_hook(_logits_only)


def without_kv_cache(model: nn.Module) -> None:
    """Called without its key/value cache: transformers makes one in training too (from config.use_cache), which
    tessel never reads (sampling runs whole windows), and each layer appends to it, so a recomputed layer
    (parallel.recompute = "full") appends its keys a second time (a different shape, torch.utils.checkpoint's
    CheckpointError, or a cache twice as long) and a compiled one meets Python state dynamo cannot trace. The
    model's own config is left as it is (an exported config keeps its use_cache)."""
    model.register_forward_pre_hook(_no_cache, with_kwargs=True)


def _no_cache(module: nn.Module, args: tuple, kwargs: dict):
    return args, {**kwargs, "use_cache": False}


def _logits_only(module: nn.Module, args, output):
    """transformers' ModelOutput -> its logits: what tessel's losses and samplers take."""
    logits = output.get("logits") if isinstance(output, dict) else None
    return output if logits is None else logits
