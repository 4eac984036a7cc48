"""The network of the seeds at 1,024 GPUs (issue 18): what rails and SHARP gain in the simulator, and
that each can change the chosen layout."""

import pytest

from tessel.planner.cluster import get_cluster
from tessel.planner.fabric import gain_lines, network_gains
from tessel.planner.model_spec import preset


@pytest.fixture(scope="module")
def rows():
    # GPT-3 6.7B on 128 DGX A100 nodes, without pipelines (the search's pp=1 layouts keep the test fast), with
    # Megatron's 1D tensor parallelism: a grid (tp_mode 3d) moves less over the NICs without rails, and what
    # the grids gain is tests/planner/test_grid_search.py's
    spec = preset("gpt3-6.7b")
    found = network_gains(spec, get_cluster("a100", 1024), 1024, spec.global_batch, fixed={"pp": 1, "tp_mode": "1d"})
    return {r.variant: r for r in found}


def test_rails_change_the_layout_and_gain_in_the_simulator(rows):
    flat, rails = rows["no rails"], rows["rails"]
    # without rails a dp ring crosses the NICs with the whole buffer: tp fills the node (tp8) so that one
    # GPU per node is in each dp group; with rails each of a node's dp members carries 1/k on its own rail
    assert flat.layout.tp == 8 and rails.layout.tp < 8
    assert rails.simulated_s < 0.9 * flat.simulated_s
    assert rails.baseline_layout_s > rails.simulated_s  # the rail-less winner is worse on rails
    assert flat.baseline_layout_s == flat.simulated_s


def test_sharp_changes_the_layout_without_rails(rows):
    flat, sharp = rows["no rails"], rows["no rails + SHARP"]
    # the switches reduce: a plain all-reduce (ZeRO-0) of every gradient becomes cheaper than ZeRO-3's
    # gathers and reduce-scatters, which SHARP does not accelerate
    assert sharp.layout != flat.layout and sharp.layout.zero_stage == 0
    assert sharp.simulated_s < 0.9 * flat.simulated_s
    # analytic and simulated agree on every winner
    for r in rows.values():
        assert r.analytic_s == pytest.approx(r.simulated_s, rel=0.05), r.variant


def test_gain_lines_name_each_variant(rows):
    text = "\n".join(gain_lines(list(rows.values())))
    assert text.count("throughput over no rails") == 3 and "chooses" in text
