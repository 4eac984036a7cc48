"""2D, 2.5D and 3D tensor parallelism in the planner's search (tessel.planner.grid_cost, tessel.planner.search).

What a grid sends per linear layer is tessel.planner.tp_grid.linear_bytes, the closed form the runtime's recorded
collectives are tested against (tests/parallel/tensor_nd); the planner prices call lists whose bytes are that
form, and a whole recorded step equals its list there. Here: the lists' bytes, the cost model's per-step bytes,
the layouts the search enumerates (tessel.config accepts every one), and where a grid wins and where 1D does.
"""

import json
from dataclasses import replace

import pytest
from typer.testing import CliRunner

from tessel.commands.cli import app
from tessel.config import build_config, check_layout, load_config
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.grid_cost import Grid, grid_sizes
from tessel.planner.layout import Layout, layout_config, layout_text, parse_layout
from tessel.planner.model_spec import ModelSpec, from_config, preset
from tessel.planner.search import grid_layouts, search
from tessel.planner.tp_grid import MIXED, STREAM, linear_bytes, linear_calls
from tessel.planner.traffic import sent_bytes
from tessel.commands.planning import recipe_allows


def _sent(calls, dims) -> float:
    return sum(sent_bytes([c], dims[a]) for a, c in calls)


@pytest.mark.parametrize("grid", [Grid("2d", 2), Grid("2d", 8), Grid("2.5d", 2, 2), Grid("2.5d", 4, 3),
                                  Grid("3d", 2), Grid("3d", 8)])
def test_each_linear_sends_the_closed_form(grid):
    for n, k, m in ((12288, 1024, 1024), (49152, 12288, 49152), (196608, 2048, 256)):  # they divide evenly
        for layout in (STREAM, MIXED):
            fwd, bwd = linear_calls(grid.mode, n, k, m, grid.side, grid.depth, 2, layout)
            want = linear_bytes(grid.mode, n, k, m, grid.side, grid.depth, 2)
            assert _sent(fwd + bwd, grid.dims) == pytest.approx(want, rel=1e-12), (grid, n, k, m, layout)


@pytest.mark.parametrize("mode,depth,recompute,forward_share", [
    ("2d", 1, "none", 0.0), ("2.5d", 4, "none", 0.0), ("2d", 1, "full", 1 / 3), ("3d", 1, "full", 1 / 2)])
def test_a_steps_tp_bytes_are_the_closed_forms(mode, depth, recompute, forward_share):
    """GPT-3 1.3B with a 64-rank tp group: per micro-batch, every block's seven linear layers send linear_bytes,
    and full recomputation sends their forward's share again (SUMMA's forward is 1/3 of its broadcasts and
    reductions, the cube's 3 of its 6 collectives); the head is one more linear layer, and the embedding's fp32
    table pieces are gathered forward and reduce-scattered backward (2.5D: summed over the depth too). The rest
    (two norms per block, the loss's scalars) is under 0.5%."""
    spec = preset("gpt3-1.3b")
    cm = CostModel(spec, get_cluster("a100", 1024), "bf16")
    lay = Layout(dp=16, tp=64, micro_batch=16, grad_accum=2, tp_mode=mode, tp_depth=depth, recompute=recompute)
    side = {"2d": 8, "2.5d": 4, "3d": 4}[mode]
    c, n = spec.cfg, lay.micro_batch * spec.seq_len
    shapes = [(c.d_model, c.d_model)] * 4 + [(c.d_model, c.ffn_dim)] * 2 + [(c.ffn_dim, c.d_model)]
    block = sum(linear_bytes(mode, n, k, m, side, depth, 2) for k, m in shapes)
    closed = c.n_layer * block * (1 + forward_share) + linear_bytes(mode, n, c.d_model, c.vocab_size, side, depth, 2)
    table = 4 * c.vocab_size * c.d_model
    closed += {"2d": 2 * (side - 1) / side * table / side,
               "2.5d": 2 * (side - 1) / side * table / side + 2 * (depth - 1) / depth * table / side ** 2,
               "3d": 2 * (side - 1) / side * (table / side ** 2 + table / side)}[mode]
    est = cm.estimate(lay)
    per_micro_batch = est.comm_bytes["tp"] / lay.chunks
    assert closed < per_micro_batch < 1.005 * closed, (per_micro_batch, closed)
    # what the estimate counts is what step_calls lists for the same rank, group by group
    dims = cm.grid.groups(lay)
    listed = sum(sent_bytes(calls, dims[int(g[3:])].n) for g, calls in cm.step_calls(lay, 0).items()
                 if g.startswith("tp."))
    assert listed == pytest.approx(est.comm_bytes["tp"], rel=1e-9)


def test_grids_of_a_world():
    sizes = grid_sizes(64)
    assert ("2d", 64, 1) in sizes and ("3d", 64, 1) in sizes and ("2.5d", 64, 4) in sizes and ("2.5d", 32, 2) in sizes
    assert all(d <= round((tp / d) ** 0.5) for mode, tp, d in sizes if mode == "2.5d")  # Wang et al.: d <= q
    assert not [s for s in grid_sizes(12) if s[0] != "2d"] and ("2d", 4, 1) in grid_sizes(12)


@pytest.mark.parametrize("tied", [False, True])
def test_every_grid_layout_the_search_tries_is_a_valid_recipe(tied):
    """The search enumerates grids by tessel.config's own rules: each layout written as a recipe (sampling on,
    tied embeddings or not) passes them."""
    base = build_config({}, ["model.d_model=64", "model.n_head=8", "model.n_layer=4", "train.global_batch=32",
                             "train.seq_len=32", "train.sample_tokens=8", f"model.tie_embeddings={str(tied).lower()}"])
    spec = from_config(base.model, base.train.seq_len, base.train.global_batch)
    cm = CostModel(spec, get_cluster("a100", 16), "bf16")
    layouts = grid_layouts(cm, 16, 32)
    assert {lay.tp_mode for lay in layouts} == {"2d", "2.5d", "3d"}
    assert {lay.tp for lay in layouts} >= {4, 16, 8}
    assert {lay.pp for lay in layouts} == ({1} if tied else {1, 2, 4})  # a tied head: no pipeline under a grid
    for lay in layouts:
        cfg = layout_config(base, lay)  # raises ConfigError on any rule broken
        assert (cfg.parallel.tp_mode, cfg.parallel.tp_depth) == (lay.tp_mode, lay.tp_depth)
        assert parse_layout(layout_text(lay), 32) == lay


def _h128() -> ModelSpec:
    """GPT-3 175B's shape with 128 heads, so that 1D can split it 64 ways too."""
    base = preset("gpt3-175b")
    return ModelSpec("gpt3-175b-h128", base.cfg.model_copy(update={"n_head": 128}), base.seq_len, 256)


def _best_per_mode(cm: CostModel, world: int, fixed: dict) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in search(cm, world, cm.spec.global_batch, fixed).ranked:
        out.setdefault(e.layout.tp_mode, e.step_s)
    return out


def test_a_grid_wins_a_large_tp_group():
    """A 64-rank tp group spans 8 nodes: 1D all-reduces the whole activation across them for every pair of
    linear layers, the cube moves 1/16 of that in groups of 4 (Bian et al. 2021): faster on HDR InfiniBand
    and, by more, on 100G Ethernet."""
    spec = _h128()
    for bandwidth in (25e9, 12.5e9):
        a100 = get_cluster("a100", 128)
        cm = CostModel(spec, replace(a100, inter=replace(a100.inter, bandwidth=bandwidth)), "bf16")
        best = search(cm, 128, spec.global_batch, {"tp": 64}).best
        assert best.layout.tp_mode == "3d", (bandwidth, best.layout.describe())
        times = _best_per_mode(cm, 128, {"tp": 64})
        assert {"1d", "2d", "3d"} <= set(times) and times["3d"] < 0.7 * times["1d"], times


def test_the_search_picks_a_grid_unpinned():
    """GPT-3 6.7B on 1,024 A100s whose nodes have no rails (the dp rings cross one NIC per node), pp = 1: the
    search's winner is the cube on 8 ranks. Against 1D's best at the same tp8 ZeRO-3, each rank computes an
    eighth of every op (1D's ranks cast and normalise whole activations) and moves a fifth fewer tp bytes."""
    spec = preset("gpt3-6.7b")
    cm = CostModel(spec, replace(get_cluster("a100", 1024), rails=False), "bf16")
    result = search(cm, 1024, spec.global_batch, {"pp": 1})
    best = result.best
    assert (best.layout.tp_mode, best.layout.tp) == ("3d", 8), best.layout.describe()
    one_d = next(e for e in result.ranked if e.layout.tp_mode == "1d")
    assert (one_d.layout.tp, one_d.layout.zero_stage, best.layout.zero_stage) == (8, 3, 3), one_d.layout.describe()
    assert best.comm_bytes["tp"] < 0.85 * one_d.comm_bytes["tp"]
    assert best.time["compute"] < 0.9 * one_d.time["compute"] and best.step_s < 0.9 * one_d.step_s


def test_1d_wins_small_layers_inside_a_node():
    """GPT-3 1.3B on 16 A100s: the search's winner is 1D, and so is a 4-rank tp group inside a node, where
    SUMMA's 24 broadcasts and reductions per layer cost more than Megatron's 4 all-reduces over NVLink."""
    spec = preset("gpt3-1.3b")
    cm = CostModel(spec, get_cluster("a100", 16), "bf16")
    assert search(cm, 16, spec.global_batch).best.layout.tp_mode == "1d"
    times = _best_per_mode(cm, 16, {"tp": 4})
    assert set(times) == {"1d", "2d"} and times["1d"] < times["2d"], times


def test_plan_fix_tp_mode_writes_a_recipe_train_accepts(tmp_path):
    out = tmp_path / "plan.toml"
    res = CliRunner().invoke(app, ["plan", "recipes/tiny.toml", "--cluster", "a100", "--world", "4", "--fix",
                                   "tp_mode=2d", "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "tp4(2d)" in res.output
    cfg = load_config(out)  # and the checks `tessel train` runs before spawning
    check_layout(cfg, world_size=4)
    assert (cfg.parallel.tp, cfg.parallel.tp_mode) == (4, "2d")


def test_simulate_tp_modes_marks_a_winner_per_group_size():
    res = CliRunner().invoke(app, ["simulate", "--model", "gpt3-1.3b", "--world", "64", "--cluster", "a100",
                                   "--tp-modes", "8,16", "--json"])
    assert res.exit_code == 0, res.output
    rows = json.loads(res.output)["rows"]
    assert [(r["tp"], r["mode"]) for r in rows] == [(t, m) for t in (8, 16) for m in ("1d", "2d", "2.5d", "3d")]
    for size in (8, 16):
        timed = [r for r in rows if r["tp"] == size and "simulated_step_s" in r]
        assert sum(r.get("wins", False) for r in timed) == 1
        assert min(timed, key=lambda r: r["simulated_step_s"]).get("wins")
    assert next(r for r in rows if (r["tp"], r["mode"]) == (8, "2d"))["why"] == "8 is no q x q grid"


def test_a_recipe_that_checkpoints_keeps_grids_under_zero():
    """A grid under ZeRO writes checkpoints of logical tensors (tessel.parallel.zero.checkpoint cuts a grid's
    blocks by their placement): planning a recipe that saves them, the search keeps those layouts, and the
    recipe it writes for the fastest of them is one `tessel train` accepts, checkpoints and all."""
    base = build_config({}, ["model.d_model=64", "model.n_head=8", "model.n_layer=4", "train.global_batch=32",
                             "train.seq_len=32", "checkpoint.every=10"])
    cm = CostModel(from_config(base.model, base.train.seq_len, base.train.global_batch), get_cluster("a100", 8),
                   "bf16")
    every = search(cm, 8, 32, {"tp_mode": "2d"}).ranked
    allowed = search(cm, 8, 32, {"tp_mode": "2d"}, allow=recipe_allows(base)).ranked
    assert [e.layout for e in allowed] == [e.layout for e in every]
    recipe = layout_config(base, next(e.layout for e in allowed if e.layout.zero_stage))
    check_layout(recipe, world_size=8)
    assert (recipe.parallel.tp_mode, recipe.checkpoint.every) == ("2d", 10) and recipe.parallel.zero_stage > 0
