"""The model a recipe names: the reference GPT, or a Hugging Face architecture from its local config.

Either way a plain single-device nn.Module that maps token ids (B, T) to logits
(B, T, V); tessel.parallelize cuts it afterwards.
"""

from __future__ import annotations

import torch.nn as nn

from tessel.config import ModelConfig
from tessel.models.gpt import GPT
from tessel.models.hf.build import build_hf


def build_model(m: ModelConfig) -> nn.Module:
    return GPT(m) if m.hf_config is None else build_hf(m.hf_config)
