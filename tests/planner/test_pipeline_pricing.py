"""One pricing of schedules (issue 18): the closed form of a pipeline flush against the event
simulator replaying the runtime's own action lists, and the search's re-pricing where they part.

The closed form (tessel.planner.pricing.pipeline.pipeline_time) charges the busiest stage m
times and the other stages' work once, spread over v chunks: exact for even
stages, within 3% with the LM head's heavier last chunk (checked here for every
schedule, up to the issue's pp35 v3 and pp64 v2). A remainder of layers
(chunks of unequal depth) moves the fill and drain by whole chunks, which no
per-stage total sees; those are priced by the simulator in the search.
"""

from dataclasses import replace

import pytest

from tessel.config import build_config
from tessel.errors import ConfigError
from tessel.commands.planning import recipe_allows
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout
from tessel.planner.model_spec import preset
from tessel.planner.pricing.pipeline import pipeline_time
from tessel.planner.schedule import flush_time, held_micro_batches
from tessel.planner.search import search, simulated, simulated_flush
from tessel.planner.simulate import simulate_pipeline, simulate_plan

# (schedule, pp, m, v): chunk times from the a100 roofline of 175B's blocks, the head on the last chunk
FLUSHES = [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("1f1b", 8, 3, 1), ("interleaved", 4, 8, 2),
           ("interleaved", 4, 16, 4), ("interleaved", 35, 70, 3), ("interleaved", 64, 128, 2)]


def _chunk_times(pp, v, layers_per_chunk=2, head=0.4):
    block_f, block_b = 1.0, 2.0  # backward twice the forward; the head adds `head` blocks' worth
    times = [[(layers_per_chunk * block_f, layers_per_chunk * block_b) for _ in range(v)] for _ in range(pp)]
    f, b = times[-1][-1]
    times[-1][-1] = (f + head * block_f, b + head * block_b)
    f, b = times[0][0]
    times[0][0] = (f + 0.05, b + 0.1)  # the embedding on the first
    return times


@pytest.mark.parametrize("schedule,pp,m,v", FLUSHES)
def test_formula_agrees_with_the_simulator_within_3_percent(schedule, pp, m, v):
    for head in (0.0, 0.4, 1.0):
        times = _chunk_times(pp, v, head=head)
        sim = simulate_pipeline(times, schedule, m, v).step_s
        formula = pipeline_time([sum(f + b for f, b in row) for row in times], m, v, 0.0)
        assert formula == pytest.approx(sim, rel=0.03), (head, formula, sim)


def test_interleaving_charges_the_head_chunk_once_per_micro_batch():
    # the mispricing: (m v - 1) chunk_max + chunk_sum charged the head's chunk v times per
    # micro-batch; at pp35 v3 with a heavy head that alone cost ~25% against the simulator
    pp, m, v = 35, 70, 3
    times = _chunk_times(pp, v, head=2.0)
    sim = simulate_pipeline(times, "interleaved", m, v).step_s
    chunk_max = max(f + b for row in times for f, b in row)
    old = (m * v - 1) * chunk_max + sum(f + b for row in times for f, b in row) / pp
    assert old > 1.2 * sim
    assert pipeline_time([sum(f + b for f, b in row) for row in times], m, v, 0.0) == pytest.approx(sim, rel=0.03)


# whole steps of 175B on 1024 A100s (and 960, 40 stages): the analytic step as the search reports it
# against simulate_plan, which also replays the data-parallel traffic on shared links
PLANS = [Layout(dp=8, tp=8, pp=16, micro_batch=1, micro_batches=192, zero_stage=2, sequence_parallel=True),
         Layout(dp=8, tp=8, pp=16, micro_batch=1, micro_batches=192, schedule="gpipe", sequence_parallel=True,
                recompute="full"),
         Layout(dp=16, tp=8, pp=8, micro_batch=1, micro_batches=96, schedule="interleaved", virtual_stages=2,
                sequence_parallel=True, recompute="selective", zero_stage=1),
         # 96 layers over 16 x 4 chunks: half the chunks hold 2 blocks, half 1 (uneven)
         Layout(dp=16, tp=4, pp=16, micro_batch=2, micro_batches=48, schedule="interleaved", virtual_stages=4,
                sequence_parallel=True, recompute="full"),
         Layout(dp=32, tp=8, pp=4, micro_batch=1, micro_batches=48, schedule="interleaved", virtual_stages=4,
                sequence_parallel=True, recompute="full", zero_stage=1)]


def test_search_prices_every_schedule_as_the_simulator_does():
    spec = preset("gpt3-175b")
    cm = CostModel(spec, get_cluster("a100", 1024), "bf16")
    estimates = [cm.estimate(lay) for lay in PLANS]
    repriced = simulated(sorted(estimates, key=lambda e: e.step_s), top=len(PLANS), margin=10.0)
    assert {e.priced_by for e in repriced} == {"simulator"}
    for e in repriced:
        assert e.flush_s == pytest.approx(simulated_flush(e))
        sim = simulate_plan(cm, e.layout, e)
        assert e.step_s == pytest.approx(sim.step_s, rel=0.03), e.layout.describe()
    uneven = next(e for e in estimates if e.layout.virtual_stages == 4 and e.layout.pp == 16)
    # the closed form is off here by more than the 3% (why the search re-prices)
    assert abs(uneven.flush_s / simulated_flush(uneven) - 1) > 0.03


def test_search_reports_simulated_flushes_for_its_leaders():
    spec = preset("gpt3-13b")
    cm = CostModel(spec, get_cluster("a100", 64), "bf16")
    result = search(cm, 64, spec.global_batch, fixed={"pp": 4, "tp": 8})
    best = result.best
    assert best.priced_by == "simulator"
    assert [e.step_s for e in result.ranked] == sorted(e.step_s for e in result.ranked)


# ---- the zero-bubble and asynchronous schedules (issue 20) --------------------------------------------
NEW_FLUSHES = [("zb-h1", 4, 8, 1), ("zb-h1", 16, 64, 1), ("zb-h2", 4, 8, 1), ("zbv", 4, 8, 2), ("zbv", 8, 16, 2),
               ("2bw", 4, 8, 1), ("pipedream", 8, 16, 1)]


@pytest.mark.parametrize("schedule,pp,m,v", NEW_FLUSHES)
def test_split_and_async_flushes_agree_with_the_simulator_within_3_percent(schedule, pp, m, v):
    """flush_time (the busiest stage m times, then the wait for the first input W cannot fill: the other
    stages' forwards, half of them in ZBV's V, none in an asynchronous steady step) against the replay."""
    for head in (0.0, 0.4, 1.0):
        times = _chunk_times(pp, v, head=head)
        sim = simulate_pipeline(times, schedule, m, v).step_s
        formula = flush_time(schedule, [sum(f + b for f, b in row) for row in times],
                             [sum(f for f, _ in row) for row in times], m, v, 0.0)
        assert formula == pytest.approx(sim, rel=0.03), (head, formula, sim)


def test_held_micro_batches_are_the_runtime_lists():
    """ZB-H1 holds p micro-batches from F to W on every rank and r+1 from B to W (1F1B: p - r); an
    asynchronous step starts holding the last step's, p - r in all, as 1F1B."""
    p, m = 4, 8
    assert [held_micro_batches("1f1b", p, m, r) for r in range(p)] == [(p - r, 0) for r in range(p)]
    assert [held_micro_batches("zb-h1", p, m, r) for r in range(p)] == [(p, r + 1) for r in range(p)]
    assert all(held_micro_batches("zb-h2", p, m, r)[0] == 2 * p - 1 for r in range(p))
    assert all(held_micro_batches("zbv", p, m, r, 2)[0] <= 2 * p for r in range(p))  # half stages
    for name in ("2bw", "pipedream"):
        assert [held_micro_batches(name, p, m, r)[0] for r in range(p)] == [p - r for r in range(p)]


def test_memory_prices_captured_gradients_and_stashed_weights():
    spec = preset("gpt3-1.3b")
    cm = CostModel(spec, get_cluster("a100", 8), "bf16")
    base = Layout(dp=2, pp=4, micro_batch=1, micro_batches=16)
    mem = {s: cm.estimate(replace(base, schedule=s)).stage_memory[0] for s in ("1f1b", "zb-h1", "2bw", "pipedream")}
    assert "captured_grads" not in mem["1f1b"] and mem["zb-h1"]["captured_grads"] > 0
    params = mem["1f1b"]["params"]  # fp32 parameters of stage 0: each version is a copy of them
    assert mem["2bw"]["weight_versions"] == pytest.approx(2 * params)
    assert mem["pipedream"]["weight_versions"] == pytest.approx(4 * params)  # p - 0 micro-batches in flight
    assert mem["2bw"]["activations"] == pytest.approx(mem["1f1b"]["activations"])  # 1F1B's p - r held


def test_search_chooses_asynchronous_schedules_only_where_the_recipe_allows_them():
    spec = preset("gpt3-1.3b")
    cm = CostModel(spec, get_cluster("a100", 16), "bf16")
    fixed = {"pp": 4, "tp": 2}
    # the recipe `tessel plan --model gpt3-1.3b` writes the layouts into (tessel.commands.planning._recipe_and_model)
    recipe = {"model": spec.cfg.model_dump(exclude_none=True), "train": {"seq_len": spec.seq_len}}
    plain = recipe_allows(build_config(recipe))
    sync = search(cm, 16, spec.global_batch, fixed=fixed, simulate_top=4, allow=plain)
    assert not any(e.layout.schedule in ("2bw", "pipedream") for e in sync.ranked + sync.rejected)
    assert sync.best.layout.schedule in ("zb-h1", "zbv", "interleaved")  # no longer 1F1B's bubble
    stale = recipe_allows(build_config({**recipe, "parallel": {"allow_async": True}}))
    allowed = search(cm, 16, spec.global_batch, fixed={**fixed, "tp": 1, "dp": 4}, simulate_top=4, allow=stale)
    assert allowed.best.layout.schedule == "2bw"  # no flush: the fastest where staleness is accepted
    with pytest.raises(ConfigError, match="allow_async"):
        search(cm, 16, spec.global_batch, fixed={"schedule": "2bw"}, allow=plain)
