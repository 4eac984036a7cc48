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


def test_sequence_parallel_matmuls_keep_their_input_whole():
    """Under tp8 + SP a block's norm works on its sequence shard, but the MLP's column-parallel
    matmuls save the all-gathered input: whole on every tp rank (tessel.parallel.tensor gathers
    before the matmul; Megatron's SP saves the shard instead). Measured on one rank of a fake
    world of 8 on the meta device (fp32: autocast does not reach meta tensors), on the MLP half of
    the block (the attention half takes the math kernel on meta, unlike CPU and GPU runs)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tessel.config import build_config
    from tessel.mesh import make_mesh
    from tessel.apply import parallelize

    raw = {"model": {"vocab_size": 256, "n_layer": 1, "n_head": 8, "d_model": 128, "max_seq_len": 32},
           "train": {"steps": 10, "warmup_steps": 1, "global_batch": 8, "seq_len": 32, "precision": "fp32"},
           "data": {"source": "synthetic"}, "logging": {"progress": False, "tensorboard": False}}
    cfg = build_config(raw, ["parallel.tp=8", "parallel.sequence_parallel=true"])
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    try:
        with torch.device("meta"):
            model = GPT(cfg.model)
        block = parallelize(model, make_mesh({"tp": 8}, rank=0), cfg).model.layers[0]
        skip = {p.untyped_storage()._cdata for p in block.parameters()}  # meta storages have no address
        seen: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.untyped_storage()._cdata not in skip:
                seen[t.untyped_storage()._cdata] = t.untyped_storage().nbytes()
            return t

        x = torch.zeros(3, 32 // 8, 128, device="meta", requires_grad=True)  # this rank's sequence shard
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block.mlp(block.mlp_norm(x))
    finally:
        dist.destroy_process_group()
    tokens, d, ffn, heads, tp = 3 * 32, 128, cfg.model.ffn_dim, 8, 8
    mlp_half = tokens * ((2 * d * 4 + 4) / tp + d * 4 + 4 * ffn * 4 / tp)  # norm's x, x/rms, rms; whole input
    assert sum(seen.values()) == mlp_half
    attention_half = tokens * ((2 * d * 4 + 4) / tp + d * 4 + (5 * d * 4 + heads * 4) / tp)
    spec = from_config(cfg.model, 32, 3)
    assert layer_activation_bytes(spec, tokens, tp, True, "fp32") == mlp_half + attention_half
