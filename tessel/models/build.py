"""The model a recipe names: the reference GPT, or a Hugging Face architecture from its local config.

Either way a plain single-device nn.Module that maps token ids (B, T) to logits
(B, T, V); tessel.parallelize cuts it afterwards. With model.init_from its
initial weights are read from safetensors (tessel.models.weights) on every
rank, before anything is cut.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessel.config import ModelConfig
from tessel.errors import ConfigError
from tessel.models.gpt import GPT
from tessel.models.hf.build import build_hf
from tessel.models.hf.convert import hf_naming
from tessel.models.weights import Naming, WeightsError, check_against, load_weights


def build_model(m: ModelConfig) -> nn.Module:
    """The model `m` names, with model.init_from's weights; one built on the meta device (for its
    names and shapes) reads no weights."""
    model = GPT(m) if m.hf_config is None else build_hf(m.hf_config)
    if m.init_from is not None and not next(model.parameters()).is_meta:
        load_weights(model, m.init_from, naming(model, m))
    return model


def naming(model: nn.Module, m: ModelConfig) -> Naming:
    """The names a weights file of this model may use besides its own."""
    return Naming() if m.hf_config is None else hf_naming(model)


def check_init_from(m: ModelConfig) -> None:
    """ConfigError('model.init_from') unless its files hold exactly the model's tensors with its shapes;
    checked on the meta device from the files' headers, before any process starts."""
    if m.init_from is None:
        return
    with torch.device("meta"):
        model = build_model(m)
    try:
        check_against(model, m.init_from, naming(model, m))
    except WeightsError as err:
        raise ConfigError("model.init_from", f"{m.init_from}: {err}") from None
