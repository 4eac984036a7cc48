"""The planner's ZeRO and activation memory against the papers' accounting (issue 18).

ZeRO: Rajbhandari et al. 2020, sec. 3.1 and 5: with fp16/bf16 parameters and fp32 master
weights a parameter costs 2 + 2 + K bytes, K = 12 (master, momentum, variance); stage 1 divides
the optimizer state over the N data-parallel ranks, stage 2 the gradients too, stage 3 the
parameters too. Selective recompute: Korthikanti et al. 2022, sec. 4.1 and 5.
No processes: pure arithmetic, well under a second.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout
from tessel.planner.memory import attention_core_bytes, layer_activation_bytes, zero_state_bytes
from tessel.planner.model_spec import preset

PSI = 1.75e11  # GPT-3 175B's parameters: any count works, the accounting is per parameter
DPS = [2**k for k in range(11)]  # dp 1 to 1024


def paper(stage: int, n: int) -> dict[str, float]:
    """The ZeRO paper's per-rank bytes (sec. 5.1-5.3, Figure 1): P_os, P_os+g, P_os+g+p."""
    return {"params": 2 * PSI / (n if stage >= 3 else 1), "grads": 2 * PSI / (n if stage >= 2 else 1),
            "optimizer": 12 * PSI / (n if stage >= 1 else 1)}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_mixed_precision_equals_the_paper_plus_what_tessel_keeps(stage):
    """bf16 storage, bf16 reduction: the paper's three terms, plus tessel's fp32 gradient of the owned
    shard (its optimizer steps fp32 gradients: tessel.parallel.zero.gradients); stage 3 keeps the
    fp32 master as its only parameter shard, so its total is the paper's 16/N exactly."""
    for n in DPS:
        got, want = zero_state_bytes(PSI, stage, n, param_bytes=2, reduce_bytes=2), paper(stage, n)
        assert got["optimizer"] == pytest.approx(want["optimizer"])
        assert got["grads"] == pytest.approx(want["grads"])
        extra = {1: 4 * PSI / n, 2: 2 * PSI / n, 3: 2 * PSI / n}[stage]  # the owned fp32 gradient beyond bf16
        assert got["fp32_grads"] == pytest.approx(extra)
        if stage < 3:
            assert got["params"] == pytest.approx(want["params"])
            assert sum(got.values()) == pytest.approx(sum(want.values()) + extra)
        else:
            assert got["params"] == 0  # no bf16 shard: each gather casts the fp32 master
            assert sum(got.values()) == pytest.approx(16 * PSI / n)  # = 2/N + 2/N + 12/N


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_fp32_storage_is_what_the_runtime_keeps(stage):
    """parallel.zero_param_dtype = fp32 (tessel's default; always without ZeRO): fp32 parameters that
    are their own masters, fp32 gradients, AdamW's two fp32 moments: 4 + 4 + 8 bytes, divided as
    the stage divides them (the table in tessel.parallel.zero.zero_parallel)."""
    for n in DPS:
        got = zero_state_bytes(PSI, stage, n)
        assert got["params"] == pytest.approx(4 * PSI / (n if stage >= 3 else 1))
        assert got["grads"] == pytest.approx(4 * PSI / (n if stage >= 2 else 1))
        assert got["optimizer"] == pytest.approx(8 * PSI / (n if stage >= 1 else 1))
        assert got["fp32_grads"] == 0  # the fp32 reduced buffer is the optimizer's gradient


def test_pipeline_keeps_whole_gradients_and_the_owned_shard():
    """Under a pipeline gradients accumulate whole over the step, then ZeRO-2/3 reduce-scatter them
    into the owned fp32 shard, which stays allocated (tessel.parallel.zero.pipeline)."""
    for stage in (2, 3):
        got = zero_state_bytes(PSI, stage, 8, whole_grads=True)
        assert got["grads"] == pytest.approx(4 * PSI) and got["fp32_grads"] == pytest.approx(4 * PSI / 8)


def test_cost_model_follows_param_dtype():
    """The layout's param_dtype reaches the memory: bf16 storage under ZeRO-1 costs 2 + 2 + 12/N (+4/N)
    per parameter where fp32 storage costs 4 + 4 + 8/N."""
    spec = preset("gpt3-1.3b")
    model = CostModel(spec, get_cluster("a100", 64), "bf16")
    fp32 = model.estimate(Layout(dp=64, zero_stage=1, micro_batch=8, micro_batches=1)).memory
    bf16 = model.estimate(Layout(dp=64, zero_stage=1, micro_batch=8, micro_batches=1, zero_param_dtype="bf16")).memory
    psi = fp32["params"] / 4
    assert bf16["params"] == pytest.approx(2 * psi) and bf16["grads"] == pytest.approx(2 * psi)
    assert bf16["optimizer"] == pytest.approx(12 * psi / 64) and bf16["fp32_grads"] == pytest.approx(4 * psi / 64)


def test_gpu_preset_takes_no_host_workspace():
    """gloo's host copies measured on this CPU belong to it: on the A100 preset, even with a cached
    probe's workspace in the cluster, a tiny model needs no more memory under ZeRO-2 than plain DP."""
    from tessel.config import ModelConfig
    from tessel.planner.model_spec import from_config

    measured = {"all_gather": 0.88, "reduce_scatter": 1.12, "all_reduce": 0.12}  # a probe's, at 4 ranks
    a100 = replace(get_cluster("a100", 4), collective_workspace=measured)
    assert a100.workspace() == {}
    spec = from_config(ModelConfig(vocab_size=256, n_layer=2, n_head=4, d_model=64, max_seq_len=32), 32, 16)
    model = CostModel(spec, a100, "bf16")
    plain = model.estimate(Layout(dp=4, micro_batch=4, micro_batches=1)).memory
    zero2 = model.estimate(Layout(dp=4, zero_stage=2, micro_batch=4, micro_batches=1)).memory
    assert zero2["total"] <= plain["total"]
    assert zero2["params"] + zero2["grads"] + zero2["optimizer"] < plain["params"] + plain["grads"] + plain["optimizer"]


def test_selective_recompute_drops_the_papers_attention_core():
    """Korthikanti et al. 2022 (Table 2, sec. 4.1): per layer sbh(34 + 5as/h) bytes in 16 bits; the
    attention core's 5as^2b is softmax output 2as^2b + dropout mask as^2b + dropout output 2as^2b,
    all split by t. tessel trains without dropout, so an unfused core keeps the softmax output only:
    2as^2b/t, which is what selective recompute drops beyond q, k and the attention output. A fused
    kernel keeps no s^2 term at all. GPT-3 175B's shape: s 2048, h 12288, a 96, t 8, b 1."""
    spec = preset("gpt3-175b")
    s, h, a, t = spec.seq_len, spec.cfg.d_model, spec.cfg.n_head, 8
    unfused = attention_core_bytes(spec, s, t, "bf16", fused=False)
    fused = attention_core_bytes(spec, s, t, "bf16", fused=True)
    softmax_out = 2 * a * s * s / t
    assert unfused - fused == pytest.approx(softmax_out)
    paper_core = 5 * a * s * s / t
    assert paper_core - (1 + 2) * a * s * s / t == pytest.approx(softmax_out)  # less the dropout's two terms
    # what selective recompute saves of the paper's layer at this shape (its sec. 5: about 70%)
    assert 5 * a * s / h / (34 + 5 * a * s / h) == pytest.approx(0.70, abs=0.02)


def test_cost_model_drops_the_core_of_every_kept_layer_under_selective():
    """Selective recompute keeps every layer but its attention core, and rebuilds one core at a time;
    full recompute keeps each block's input, 2sbh/t under SP in bf16 (here fp32: 4sbh/t)."""
    spec = preset("gpt3-175b")
    cluster = replace(get_cluster("a100", 8), fused_attention=False)
    model = CostModel(spec, cluster, "bf16")
    lay = Layout(tp=8, sequence_parallel=True, micro_batch=1, micro_batches=1536)
    none, selective = (model.estimate(replace(lay, recompute=r)).memory["activations"] for r in ("none", "selective"))
    core = attention_core_bytes(spec, spec.seq_len, 8, "bf16", fused=False)
    assert none - selective == pytest.approx((spec.cfg.n_layer - 1) * core)
