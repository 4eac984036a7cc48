"""Context parallelism in the cost model (tessel.planner.context) and the search: no processes.

What a cp layout costs per rank by hand on small cases (its traffic per block, its ZeRO shards, its
compute), that the search chooses cp for long sequences and not for short ones, and that a layout with cp
survives its text and recipe forms. The measured side (activation memory per rank against the planner's
prediction) is tests/parallel/context/test_context_parallel.py's."""

import pytest

from tessel.config import ModelConfig, build_config
from tessel.planner.cluster import Cluster, Link, get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout, config_layout, layout_config, parse_layout
from tessel.planner.model_spec import from_config
from tessel.planner.search import search
from tessel.planner.traffic import Call

GQA = ModelConfig(vocab_size=256, n_layer=2, n_head=4, n_kv_head=2, d_model=32, max_seq_len=64)


def flat_cluster(devices=8, flops=1e9, bw=1e9):
    link = Link(bw, 0.0)
    return Cluster("test", 1, devices, {"fp32": flops, "bf16": flops}, 2**40, link, link, mem_bandwidth=1e9)


def test_the_ring_and_ulysses_send_what_the_runtime_sends_per_block():
    cm = CostModel(from_config(GQA, 64, 8), flat_cluster(), "bf16")
    local, q, kv = 2 * 64 // 4, 32, 16  # mb 2 of 64 tokens over cp4; 4 heads of 8, 2 kv heads
    ring = cm.step_calls(Layout(cp=4, micro_batch=2, grad_accum=4))["cp"]
    block = 2 * local * kv * 2  # k and v in bf16; their gradient travels in fp32
    per_step = 2 * 4  # two blocks, four micro-batches
    assert sorted(ring, key=lambda c: c.nbytes) == [Call("p2p", block, 2 * 3 * per_step),  # kv: forward, backward
                                                   Call("p2p", 2 * block, 4 * per_step)]  # its gradient: 4 hops
    ulysses = cm.step_calls(Layout(cp=2, cp_mode="ulysses", micro_batch=2, grad_accum=4))["cp"]
    local = 2 * 64 // 2  # q and the output, k and v: there and back again in backward
    assert sorted(ulysses, key=lambda c: c.nbytes) == [Call("all_to_all", local * kv * 2, 2 * 2 * per_step),
                                                      Call("all_to_all", local * q * 2, 2 * 2 * per_step)]


def test_cp_divides_each_ranks_work_and_zero_shards_over_it():
    cm = CostModel(from_config(GQA, 64, 8), flat_cluster(), "fp32")
    one, four = cm.estimate(Layout(micro_batch=8)), cm.estimate(Layout(cp=4, micro_batch=8))
    # every FLOP of a micro-batch is split four ways, attention's included (the balanced layout)
    assert four.time["compute"] == pytest.approx(one.time["compute"] / 4, rel=1e-9)
    assert four.memory["activations"] < 0.3 * one.memory["activations"]
    # ZeRO-1 over dp x cp: the optimizer's state in 4 shards; the gradients are averaged over all 4 ranks
    zero = cm.estimate(Layout(dp=2, cp=2, micro_batch=4, zero_stage=1))
    assert zero.memory["optimizer"] == pytest.approx(one.memory["optimizer"] / 4)
    assert zero.comm_bytes["dp"] > 0 and zero.placement["cp"] == "intra"


def test_the_search_splits_long_sequences_and_not_short_ones():
    def best(seq: int) -> Layout:
        cfg = ModelConfig(vocab_size=50304, n_layer=24, n_head=16, d_model=2048, max_seq_len=seq)
        return search(CostModel(from_config(cfg, seq, 8), get_cluster("a100", 8), "bf16"), 8, 8).best.layout
    assert best(4096).cp == 1
    long = best(131072)
    assert long.cp > 1 and long.cp * long.tp <= 8  # one node


def test_a_cp_layout_survives_its_text_and_its_recipe():
    lay = parse_layout("dp=2,cp=2,cp_mode=ulysses,mb=2", global_batch=8)
    assert lay.world == 4 and lay.token_shards == 4 and lay.axis_sizes["cp"] == 2
    assert lay.describe().startswith("dp2 cp2(ulysses)")
    base = build_config({"model": {"max_seq_len": 64}, "train": {"seq_len": 64}, "data": {"source": "synthetic"}})
    cfg = layout_config(base, lay)
    assert (cfg.parallel.cp, cfg.parallel.cp_mode, cfg.parallel.world_size) == (2, "ulysses", 4)
    assert config_layout(cfg) == lay
