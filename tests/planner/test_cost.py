"""The cost model's formulas against hand calculations on small cases (no processes)."""

import math

import pytest

from tessel.config import ConfigError
from tessel.models.gpt import GPT, count_params, flops_per_token
from tessel.planner.cluster import Link, get_cluster, link_for
from tessel.planner.calibration import Calibration
from tessel.planner.cost import CostModel, all_gather_time, all_reduce_time, all_to_all_time, p2p_time
from tessel.planner.pricing.pipeline import chunk_layers, peak_chunks_in_flight
from tessel.planner.layout import Layout, parse_layout
from tessel.planner.memory import head_activation_bytes, layer_activation_bytes, recompute_layer_bytes, zero_shards
from tessel.planner.model_spec import from_config, preset
from tessel.planner.schedule import bubble_fraction, peak_in_flight, stage_ops
from tests.planner.cases import TINY, flat_cluster, tiny_spec

LINK = Link(1e9, 1e-5)


def test_collective_times_by_hand():
    # ring all-reduce, n=4, 1 MB: 2*3/4 * 1e6 B / 1e9 B/s + 2*3 * 10 us
    assert all_reduce_time(1e6, 4, LINK) == pytest.approx(1.5e-3 + 6e-5)
    assert all_gather_time(1e6, 4, LINK) == pytest.approx(0.75e-3 + 3e-5)
    assert all_to_all_time(1e6, 4, LINK) == pytest.approx(0.75e-3 + 3e-5)
    assert p2p_time(1e6, LINK) == pytest.approx(1e-3 + 1e-5)
    assert all_reduce_time(1e6, 1, LINK) == all_gather_time(1e6, 1, LINK) == 0.0


def test_param_and_flop_counts_match_the_reference_model():
    spec = tiny_spec()
    # by hand: attention 4*32*32 = 4096; SwiGLU width 16*ceil(8*32/3/16) = 96, 3*32*96 = 9216;
    # two norms 64 -> 13376 per block; embedding 8192; final norm + head 32 + 8192
    assert spec.total_params == 2 * 13376 + 8192 + 8224 == count_params(GPT(TINY))
    # 6 * (2 blocks * 13312 matmul weights + 8192 head) + 12 * L * d * T
    assert spec.model_flops_per_token() == 6 * (2 * 13312 + 8192) + 12 * 2 * 32 * 16
    assert spec.model_flops_per_token() == flops_per_token(TINY, 16)


def test_moe_params_and_flops():
    cfg = TINY.model_copy(update={"n_experts": 4, "moe_every": 2, "moe_top_k": 2})
    spec = from_config(cfg, 16, 8)
    assert spec.n_moe_layers == 1
    assert spec.layer_params(1) == (4096 + 64 + 32 * 4, 4 * 9216)  # router is dense, experts are not
    assert spec.total_params == count_params(GPT(cfg)) if _has_moe() else True
    # forward per token of the MoE block: attention 2*4096 + 4*16*32, router 2*32*4, two experts 2*2*9216
    assert spec.layer_fwd_flops_per_token(1) == 2 * 4096 + 4 * 16 * 32 + 2 * 32 * 4 + 2 * 2 * 9216


def _has_moe():
    try:
        import tessel.models.moe  # noqa: F401
        return True
    except ImportError:
        return False


def test_activation_bytes_by_hand():
    spec = tiny_spec()
    # fp32, per token (measured against the real block in tests/planner/test_activation_memory.py):
    # the stream 4 d fp32 + 2 rms floats = 520 B (split by tp under SP); the matmuls' normed inputs
    # 2 d fp32 = 256 B (whole on every tp rank); split (5*32 + 4*96) * 4 + 4 heads * 4 = 2192 B
    assert layer_activation_bytes(spec, 16, 1, False, "fp32") == 16 * (520 + 256 + 2192)
    assert layer_activation_bytes(spec, 16, 2, False, "fp32") == 16 * (520 + 256 + 2192 / 2)
    assert layer_activation_bytes(spec, 16, 2, True, "fp32") == 16 * (520 / 2 + 256 + 2192 / 2)
    assert recompute_layer_bytes(spec, 16, 2, True) == 16 * 32 * 4 / 2
    # an MoE block, 4 experts, top-2: attention part split 5*32 * 4 + 16 = 656 B; per token
    # 2 expert rows of (4*96 + 2*32) * 4 B, router probabilities 4 * 4 B = 3600 B, not split by tp
    moe = from_config(TINY.model_copy(update={"n_experts": 4, "moe_top_k": 2}), 16, 8)
    assert layer_activation_bytes(moe, 16, 1, False, "fp32", moe=True) == 16 * (520 + 256 + 656 + 3600)
    assert layer_activation_bytes(moe, 16, 2, False, "fp32", moe=True) == 16 * (520 + 256 + 656 / 2 + 3600)
    # logits 256 * (4 + 8) + final norm in/out 2 * 32 * 4
    assert head_activation_bytes(spec, 16, 1, "fp32") == 16 * (256 * 12 + 256)


def test_zero_shards():
    assert zero_shards(0, 4) == (1, 1, 1)
    assert zero_shards(1, 4) == (1, 1, 4)
    assert zero_shards(2, 4) == (1, 4, 4)
    assert zero_shards(3, 4) == (4, 4, 4)


def test_memory_of_states_by_zero_stage_pp_and_tp():
    spec = tiny_spec()
    cm = CostModel(spec, flat_cluster(), "fp32")
    P = spec.total_params
    m = cm.estimate(Layout(dp=2, zero_stage=1, micro_batch=1, grad_accum=4)).memory
    assert (m["params"], m["grads"], m["optimizer"]) == (4 * P, 4 * P, 8 * P / 2)
    m = cm.estimate(Layout(dp=2, zero_stage=3, micro_batch=1, grad_accum=4)).memory
    assert (m["params"], m["grads"], m["optimizer"]) == (2 * P, 2 * P, 4 * P)
    est = cm.estimate(Layout(pp=2, micro_batch=1, micro_batches=4))
    assert est.stage_memory[0]["params"] == 4 * (13376 + 8192)  # block 0 + embedding
    assert est.stage_memory[1]["params"] == 4 * (13376 + 8224)  # block 1 + norm + head
    assert cm.estimate(Layout(tp=2, micro_batch=1, grad_accum=4)).memory["params"] == 4 * P / 2
    # ZeRO-3 under a pipeline: the shard at rest, the whole stage gathered for the step (pipeline/zero3.py)
    s0 = cm.estimate(Layout(pp=2, dp=2, zero_stage=3, micro_batch=1, micro_batches=4)).stage_memory[0]
    assert (s0["params"], s0["buffers"]) == (4 * (13376 + 8192) / 2, 4 * (13376 + 8192))
    assert s0["grads"] == 4 * (13376 + 8192)  # accumulated whole over the micro-batches, then reduce-scattered


def test_collective_workspace_by_zero_stage():
    """gloo's copies (per byte of buffer, as the probe measures them) on top of the states."""
    from dataclasses import replace
    spec = tiny_spec()
    P = spec.total_params
    w = {"all_reduce": 0.25, "reduce_scatter": 1.5, "all_gather": 1.0}
    plain, measured = CostModel(spec, flat_cluster(), "fp32"), CostModel(
        spec, replace(flat_cluster(), collective_workspace=w), "fp32")
    extra = {}
    for zero in (0, 1, 2):
        lay = Layout(dp=2, zero_stage=zero, micro_batch=1, grad_accum=4)
        extra[zero] = measured.estimate(lay).memory["buffers"] - plain.estimate(lay).memory["buffers"]
    bucket = min(25 * 2**20, 4 * P)  # the whole tiny model fits one 25 MiB bucket
    assert extra[0] == pytest.approx(0.25 * bucket)  # one bucket all-reduced at a time
    assert extra[1] == pytest.approx(1.0 * 4 * P + 0.25 * bucket)  # publish gathers every parameter at once
    assert extra[2] == pytest.approx(1.0 * 4 * P + 1.5 * bucket)  # buckets reduce-scattered
    one_device = Layout(micro_batch=1, grad_accum=8)  # no data-parallel collectives, nothing added
    assert measured.estimate(one_device).memory["buffers"] == plain.estimate(one_device).memory["buffers"]


def test_in_flight_closed_forms_match_the_schedules():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            for s in range(p):
                for name in ("gpipe", "1f1b") if p > 1 else ("1f1b",):  # pp=1 runs chunk by chunk
                    assert peak_chunks_in_flight(name, p, m, s) == peak_in_flight(stage_ops(name, p, m, s))
                for v in (2, 3):
                    if m % p == 0 and p > 1:
                        ops = stage_ops("interleaved", p, m, s, v)
                        assert peak_chunks_in_flight("interleaved", p, m, s, v) == peak_in_flight(ops)
                        assert len(ops) == 2 * m * v


def test_bubble_formulas_and_chunking():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("gpipe", 4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction("interleaved", 4, 8, 2) == pytest.approx(3 / 19)
    assert chunk_layers(5, 2, 1) == [[0, 1, 2], [3, 4]]
    assert chunk_layers(8, 2, 2) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_step_time_by_hand_single_device_and_dp():
    spec = tiny_spec()
    cm = CostModel(spec, flat_cluster(flops=1e9), "fp32")
    P, tokens = spec.total_params, 4 * 16
    est = cm.estimate(Layout(micro_batch=1, grad_accum=4))
    compute = spec.model_flops_per_token() * tokens / 1e9  # fwd + 2x bwd at 1 GFLOP/s
    optimizer = 28 * P / 1e9  # 28 bytes touched per parameter at 1 GB/s
    assert est.step_s == pytest.approx(compute + optimizer)
    assert est.bubble == pytest.approx(0.0)
    # dp=2, nothing overlaps: + ring all-reduce of the fp32 gradients, 2*1/2 * 4P / 1e9
    est2 = cm.estimate(Layout(dp=2, micro_batch=1, grad_accum=2))
    assert est2.time["dp comm (exposed)"] == pytest.approx(4 * P / 1e9)
    assert est2.step_s == pytest.approx(compute / 2 + optimizer + 4 * P / 1e9)


def test_pipeline_step_by_hand():
    spec = tiny_spec(layers=4)
    cm = CostModel(spec, flat_cluster(flops=1e9, bw=math.inf), "fp32")
    est = cm.estimate(Layout(pp=2, micro_batch=1, micro_batches=4))
    (f0, b0), = est.chunk_times[0]
    (f1, b1), = est.chunk_times[1]
    # the first micro-batch crosses both stages, the slower (last: it holds the head) paces the other 3
    assert est.step_s == pytest.approx(3 * (f1 + b1) + (f0 + b0 + f1 + b1) + est.time["optimizer"])
    assert b1 == pytest.approx(2 * f1) and f1 > f0


def test_placement_tp_innermost():
    a100 = get_cluster("a100", 16)
    def link(**sizes):
        full = {"pp": 1, "dp": 1, "ep": 1, "tp": 1, **sizes}
        return {ax: link_for(a100, full, ("pp", "dp", "ep", "tp"), (ax,)) for ax in sizes}
    assert link(tp=8, dp=2) == {"tp": a100.intra, "dp": a100.inter}
    assert link(tp=2, dp=4, pp=2) == {"tp": a100.intra, "dp": a100.intra, "pp": a100.inter}
    assert link(tp=4, dp=4)["dp"] == a100.inter


def test_calibration_interpolates_log_linearly():
    cal = Calibration([(100, 1e9), (400, 4e9)])
    assert cal.achieved(200, 0) == pytest.approx(2e9)  # geometric midpoint
    assert cal.achieved(50, 0) == 1e9 and cal.achieved(1000, 0) == 4e9
    assert Calibration().achieved(10, 7.0) == 7.0


def test_layout_parsing_and_errors():
    lay = parse_layout("dp=2,tp=2,mb=2", 16)
    assert (lay.grad_accum, lay.global_batch) == (4, 16)
    lay = parse_layout("pp=2,dp=2,mb=1,v=2", 16)
    assert (lay.micro_batches, lay.schedule, lay.global_batch) == (8, "interleaved", 16)
    for bad in ("dp=x", "foo=1", "dp"):
        with pytest.raises(ConfigError) as err:
            parse_layout(bad, 16)
        assert err.value.field == "--layout"
    with pytest.raises(ConfigError):
        get_cluster("tpu-v9")
    assert preset("gpt3-175b").total_params == pytest.approx(175e9, rel=0.02)
