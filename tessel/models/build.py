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
from tessel.models.hf.convert import converted_by_transformers, hf_naming
from tessel.models.weights import Naming, WeightsError, check_against, load_weights


def build_model(m: ModelConfig) -> nn.Module:
    """The model `m` names, with model.init_from's weights; one built on the meta device (for its
    names and shapes) reads no weights."""
    model = GPT(m) if m.hf_config is None else build_hf(m.hf_config)
    if m.init_from is not None and not next(model.parameters()).is_meta:
        load_init_from(model, m)
    return model


def load_init_from(model: nn.Module, m: ModelConfig) -> None:
    """model.init_from's weights into `model`: read under the model's own names, or, for a Hugging Face
    model whose files use names transformers converts on load (Mixtral's per-expert tensors as
    save_pretrained writes them), through transformers' from_pretrained."""
    try:
        load_weights(model, m.init_from, naming(model, m))
    except WeightsError as direct:
        if m.hf_config is None:
            raise
        load_weights_state(model, _converted(m, direct))


def _converted(m: ModelConfig, direct: WeightsError) -> dict[str, torch.Tensor]:
    try:
        return converted_by_transformers(m.hf_config, m.init_from)
    except WeightsError as err:  # neither way fits: name the model's own mismatches, and transformers'
        raise WeightsError(f"{direct}; nor through transformers' conversions: {err}") from None


def load_weights_state(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy a state dict of the model's own class (same names, same shapes) into it."""
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            t.copy_(state[name])


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
    except WeightsError as direct:
        try:
            if m.hf_config is None:
                raise direct
            _converted(m, direct)  # reads the weights once on the CPU: only files that need converting
        except WeightsError as err:
            raise ConfigError("model.init_from", f"{m.init_from}: {err}") from None
