"""The splits of heterogeneous devices (tessel.planner.hetero), without processes."""

import pytest

from tessel.config import ConfigError
from tessel.planner.cluster import Cluster, Link
from tessel.planner.cost import CostModel
from tessel.planner.hetero import gain, layer_capacity, min_per_coord, proportional_shares, rebalanced, with_speeds
from tessel.planner.layout import Layout
from tessel.planner.model_spec import from_config
from tests.helpers import tiny_config


def test_shares_follow_speed_and_minimise_the_slowest_finish():
    assert proportional_shares([1.0, 2.0], 6) == [2, 4]
    assert proportional_shares([1.0, 1.0], 6) == [3, 3]
    assert proportional_shares([1.0, 3.0], 4) == [1, 3]
    assert proportional_shares([1.0, 100.0], 3) == [1, 2]  # everybody gets one
    assert proportional_shares([1.0, 2.0], 6, capacity=[4, 3]) == [3, 3]  # the fast one's memory is full
    with pytest.raises(ConfigError):
        proportional_shares([1.0, 2.0, 3.0], 2)
    with pytest.raises(ConfigError, match="device_memory_gib"):
        proportional_shares([1.0, 2.0], 6, capacity=[2, 2])


def test_a_replica_or_stage_runs_at_its_slowest_rank():
    sizes, order = {"pp": 2, "dp": 2, "ep": 1, "tp": 2}, ["pp", "dp", "ep", "tp"]
    speeds = [1, 2, 2, 2, 3, 3, 3, 1]  # ranks = pp-major, then dp, then tp
    assert min_per_coord(speeds, sizes, order, "pp") == [1, 1]
    assert min_per_coord(speeds, sizes, order, "dp") == [1, 1]
    assert min_per_coord([1, 1, 2, 2, 3, 3, 4, 4], sizes, order, "dp") == [1, 2]
    assert min_per_coord([1, 1, 2, 2, 3, 3, 4, 4], sizes, order, "pp") == [1, 3]


def test_with_speeds_writes_the_shares_and_the_cut():
    dp = with_speeds(tiny_config("parallel.dp=2", "train.global_batch=12", "train.grad_accum=3",
                                 'parallel.dp_split="speed"'), [1.0, 2.0])
    assert dp.parallel.dp_shares == [2, 4]
    pp = with_speeds(tiny_config("parallel.pp=2", "model.n_layer=6", 'parallel.pp_balance="speed"',
                                 "parallel.micro_batches=4"), [1.0, 2.0])
    assert pp.parallel.pp_layout == [2, 4]
    capped = with_speeds(tiny_config("parallel.pp=2", "model.n_layer=6", 'parallel.pp_balance="speed"',
                                     "parallel.micro_batches=4"), [1.0, 2.0], layer_capacity=[6, 3])
    assert capped.parallel.pp_layout == [3, 3]


def test_layer_capacity_counts_state_and_in_flight_activations():
    cfg = tiny_config("parallel.pp=2", "model.n_layer=6", "parallel.micro_batches=4")
    roomy, tight = layer_capacity(cfg, [2**30, 2**30]), layer_capacity(cfg, [2**21, 2**21])
    assert min(roomy) >= 6 and tight[0] < roomy[0]
    # the first stage holds the embedding and keeps more micro-batches in flight (1F1B): it fits fewer blocks
    assert tight[0] <= tight[1]


def test_gain_prices_the_even_and_the_proportional_split():
    cfg = tiny_config("model.n_layer=6")
    spec = from_config(cfg.model, 16, 8)
    link = Link(1e10, 1e-5)
    cm = CostModel(spec, Cluster("x", 1, 2, {"fp32": 1e9, "bf16": 1e9}, 2**33, link, link, 1e10), "fp32")
    dp = gain(cm.estimate(Layout(dp=2, micro_batch=1, grad_accum=4)), [1.0, 2.0], 6)
    assert dp.split == [3, 5] and 1.3 < dp.speedup < 1.6  # 4/1 vs max(3/1, 5/2): 1.33x less fixed costs
    pp = gain(cm.estimate(Layout(pp=2, micro_batch=1, micro_batches=8)), [1.0, 2.0], 6)
    assert pp.split == [2, 4] and 1.2 < pp.speedup <= 1.5
    assert gain(cm.estimate(Layout(dp=2, micro_batch=1, grad_accum=4)), [1.0, 1.0], 6) is None


def test_rebalanced_moves_work_in_proportion_to_the_speeds_shown():
    # forward seconds per rank over the window: rank 1 does its share 3x slower
    dp = tiny_config("parallel.dp=2", "train.global_batch=8", "train.grad_accum=4")
    new, what = rebalanced(dp, [0.1, 0.3])
    assert new.parallel.dp_shares == [6, 2] and "[4, 4] -> [6, 2]" in what
    again, why = rebalanced(new, [0.15, 0.15])  # in proportion now: each shows the same time
    assert again is None and "already" in why
    pp = tiny_config("parallel.pp=2", "model.n_layer=6", "parallel.micro_batches=4")
    new, what = rebalanced(pp, [0.3, 0.1])  # stage 0 (3 blocks) 3x slower: 10 vs 30 blocks/s
    assert new.parallel.pp_layout == [1, 5]  # 0.1 and 0.167 s, against 0.2 and 0.133 for [2, 4]
    none, why = rebalanced(tiny_config("parallel.tp=2", "parallel.dp=1"), [0.1, 0.3])
    assert none is None and "no dp share" in why
