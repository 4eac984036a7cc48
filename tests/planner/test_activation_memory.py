"""The planner's per-block activation bytes against what autograd saves in tessel's real block.

Korthikanti et al. 2022 count a GPT layer's saved activations op by op (sbh(34 + 5as/h) with
dropout, in 16 bits) and selective recompute's saving (the attention core, 5as^2b); the
planner redoes that count for tessel.models.gpt.Block (tessel.planner.memory). Here the same
block runs one forward under a saved-tensor hook at tp 1, without and with selective
recompute (tessel.parallel.recompute) and with full recompute, in fp32 and under bf16 autocast, with full and grouped
kv heads, and the bytes of the storages it saves (parameters, their bf16 casts and the rotary
tables left out, as the planner counts those apart) are compared with the planner's.
Exact to the byte (each storage counted once). Single process, a few seconds with torch start-up.
"""

from __future__ import annotations

import pytest
import torch

from tessel.config import ModelConfig
from tessel.models.gpt import GPT
from tessel.parallel.recompute import recompute_attention_cores, recompute_blocks
from tessel.planner.memory import attention_core_bytes, layer_activation_bytes, recompute_layer_bytes
from tessel.planner.model_spec import from_config

B, T = 3, 16  # 48 tokens: no activation shares a shape with a weight (d 64, ffn 176)


def saved_bytes(model: GPT, precision: str) -> int:
    """Bytes of the storages one block's forward saves for backward (each storage once)."""
    skip = {t.untyped_storage().data_ptr() for t in [*model.parameters(), model.rope_cos, model.rope_sin]}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        weight_cast = t.dim() == 2 and t.shape[0] != B * T  # autocast's bf16 copy of a weight
        if s.data_ptr() not in skip and not weight_cast:
            seen[s.data_ptr()] = s.nbytes()
        return t

    x = torch.randn(B, T, model.cfg.d_model, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"), \
            torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model.layers[0](x, model.rope_cos[:T], model.rope_sin[:T])
    return sum(seen.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_block_saves_what_the_planner_counts(precision, kv_heads):
    cfg = ModelConfig(vocab_size=64, n_layer=1, n_head=4, n_kv_head=kv_heads, d_model=64, max_seq_len=T)
    spec = from_config(cfg, T, B)
    model = GPT(cfg)
    layer = layer_activation_bytes(spec, B * T, 1, False, precision)
    assert saved_bytes(model, precision) == pytest.approx(layer)
    recompute_attention_cores(model.modules())
    core = attention_core_bytes(spec, B * T, 1, precision)
    assert saved_bytes(model, precision) == pytest.approx(layer - core)
    full = GPT(cfg)
    recompute_blocks(list(full.layers))  # full recompute: the block's fp32 input alone
    assert saved_bytes(full, precision) == recompute_layer_bytes(spec, B * T, 1, False)
