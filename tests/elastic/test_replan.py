"""fault.replan = "full": a node is lost on the 2-node emulator, and the survivors continue on a layout the
planner chose again for them, on the trajectory of an uninterrupted run from the same checkpoint."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tessel.testing.emulator import Emulator, require_root
from tessel.planner.cluster import Link
from tessel.planner.cost import CostModel
from tessel.planner.fit import Budget
from tessel.planner.hetero import priced, with_speeds
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import from_config
from tessel.planner.search import search
from tessel.elastic.replan import choose, rank_speeds, world_cluster
from tessel.elastic.dp_only import Previous
from tests.helpers import build_trainer, metrics_rows, tiny_config, write_recipe

STEPS = 8
LOST_AT = 5  # node 1 is lost at the start of step 5; the newest checkpoint is step 4's


@pytest.fixture
def no_probe(tmp_path, monkeypatch):
    """An empty cache: world_cluster prices this machine's links from a cached probe where one exists (written by
    any `tessel plan --cluster this`, the README's quick start's among them), which would change what the
    planner chooses here."""
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))


def _stopped(markers: Path) -> bool:
    return any(markers.glob(".fault-*"))


@pytest.mark.skipif(require_root() is not None, reason=str(require_root()))
def test_node_loss_replans_the_whole_layout_on_the_survivors(tmp_path):
    out, markers = tmp_path / "run", tmp_path / "faults"
    recipe = write_recipe(tmp_path / "recipe.toml", "parallel.dp=2", "parallel.tp=2", f"train.steps={STEPS}",
                          "checkpoint.every=2", "checkpoint.keep=10", "runtime.elastic=true", "fault.replan=\"full\"",
                          "fault.heartbeat_s=0.5", "fault.hang_timeout_s=120", "runtime.timeout_s=60")
    argv = ["-m", "tessel", "train", str(recipe), "--set", f'logging.out_dir="{out}"', "--resume", "auto"]
    # rank 2 (node 1) freezes at the start of step 5; the drill then takes node 1 down whole (agent and ranks)
    env = {"TESSEL_FAULT": f"stop:rank=2:step={LOST_AT}", "TESSEL_FAULT_DIR": str(markers),
           "TESSEL_CACHE": str(tmp_path / "cache")}

    def lose_node_1(emu: Emulator) -> None:
        if 1 not in emu._lost and _stopped(markers):
            emu.kill_node(1)

    emu = Emulator(nodes=2, nproc_per_node=2, rate="1gbit", min_nodes=1, max_restarts=1, keep_alive_s=1)
    with emu:
        runs = emu.run(argv, timeout=300, env=env, watch=lose_node_1)
    node0 = runs[0].log
    assert runs[0].returncode == 0, node0[-6000:]
    assert runs[1].returncode != 0  # lost
    # the survivors re-planned for 2 ranks: the report names the old layout, the new, and their step times
    report = node0[node0.index("[tessel replan] full"):]
    assert "world 4 -> 2, resumes at step 4" in report, report[:2000]
    old = re.search(r"old  (dp2 tp2 \S+)\s+4 ranks, measured ([\d.e-]+) s/step", report)
    new = re.search(r"new  (.+?)\s+2 ranks, predicted ([\d.e-]+) s/step", report)
    assert old and new, report[:2000]
    assert "dp-only would run tp2 " in report and "links probed" in report and "model profiled" in report
    measured = re.search(rf"\[tessel replan\] {re.escape(new.group(1))} on 2 ranks: measured ([\d.e-]+) s/step", node0)
    assert measured and float(measured.group(1)) > 0, node0[-3000:]
    assert f"resumed from {out}/checkpoints/step_00000004" in node0
    got = {r["step"]: r["loss"] for r in metrics_rows(out)}  # a replayed step's last row counts
    assert sorted(got) == list(range(STEPS))

    # the uninterrupted run: one process, the same global batch (dp1 x grad_accum 8), from the same checkpoint
    ref_cfg = tiny_config(f"train.steps={STEPS}", "train.grad_accum=8", "fault.heartbeat_s=0",
                          f'checkpoint.resume="{out}/checkpoints/step_00000004"', out_dir=str(tmp_path / "ref"))
    trainer, *_ = build_trainer(ref_cfg)
    ref = trainer.fit().losses
    # every layout here sums the same 8 sequences' gradients, in its own order (tp splits the matmuls,
    # dp and accumulation the batch): fp32 ulps per step, compounding over 4 AdamW steps (< 1e-6 measured)
    assert_close(torch.tensor([got[s] for s in range(4, STEPS)]), torch.tensor(ref), rtol=1e-5, atol=1e-5)


# ---- the choice, without processes -----------------------------------------------------------------
def _ranks(nodes: list[int], flops: float = 1e10) -> list[dict]:
    budget = Budget(8 * 2**30, 2**28, {}, "8 GiB each")
    return [{"node": k, "kind": "cpu", "fp32": flops, "bf16": flops, "memory": budget} for k in nodes]


def test_world_cluster_reads_nodes_links_and_the_slowest_device(no_probe):
    gbit = [[0, 40, 1, 1], [40, 0, 1, 1], [1, 1, 0, 40], [1, 1, 40, 0]]
    lat = [[0, 10, 100, 100], [10, 0, 100, 100], [100, 100, 0, 10], [100, 100, 10, 0]]
    ranks = _ranks([0, 0, 1, 1])
    ranks[3]["fp32"] = 5e9
    c = world_cluster(ranks, gbit, lat)
    assert (c.nodes, c.devices_per_node) == (2, 2)
    assert c.intra == Link(40e9 / 8, 10e-6) and c.inter == Link(1e9 / 8, 100e-6)
    assert c.peak_flops["fp32"] == 5e9 and c.memory == 8 * 2**30


def test_choose_keeps_what_may_not_change_and_refits_the_rest(no_probe):
    cfg = tiny_config("parallel.dp=2", "parallel.tp=2", "train.seed=7", "train.global_batch=8")
    one = [[0, 40], [40, 0]]
    cluster = world_cluster(_ranks([0, 0]), one, [[0, 10], [10, 0]])
    new, report = choose(cfg, 2, cluster, None, Previous(4, "dp2 tp2 mb4x1"))
    p = new.parallel
    assert p.world_size == 2 and new.train.global_batch == 8 and new.train.seed == 7
    assert new.model == cfg.model and new.train.seq_len == cfg.train.seq_len and new.train.lr == cfg.train.lr
    assert report.predicted_s > 0 and report.alternative.startswith("tp2")  # dp-only keeps tp2 and drops dp
    assert report.lines()[0] == "[tessel replan] full: world 4 -> 2"


def test_choose_prices_each_rank_at_its_own_speed(no_probe):
    cfg = tiny_config("parallel.dp=2", "parallel.tp=2", "train.global_batch=8")

    def chosen(speeds: tuple[float, ...]):
        cluster = world_cluster(_ranks([0, 0]), [[0, 40], [40, 0]], [[0, 10], [10, 0]], speeds=speeds)
        return cluster, *choose(cfg, 2, cluster, None, Previous(4, "dp2 tp2 mb4x1"))

    _, alike, alike_report = chosen(())
    cluster, new, report = chosen((1.0, 2.0))
    # alike, the planner's first is ZeRO-2, whose reduction per micro-batch cannot split unevenly; on speeds 1 and 2
    # an even split waits for the slow rank, and the split in proportion to speed (plain dp or ZeRO-1) wins
    assert alike.parallel.zero_stage == 2 and alike.parallel.dp_split == "even"
    assert new.parallel.dp_split == "speed" and new.parallel.zero_stage <= 1
    assert with_speeds(new, [1.0, 2.0]).parallel.dp_shares == [3, 5]
    # its prediction is the heterogeneous model's price of that layout on these devices
    cm = CostModel(from_config(cfg.model, cfg.train.seq_len, 8), cluster, cfg.train.precision)
    est = next(e for e in search(cm, 2, 8).ranked if e.layout == config_layout(new))
    price = priced(est, [1.0, 2.0], cfg.model.n_layer)
    assert report.predicted_s == pytest.approx(price.uneven_s) and price.uneven_s < price.even_s
    assert "speeds 1, 2" in "\n".join(report.lines()) and report.layout.endswith("dp by speed")
    # devices of speed 1 and 2 run the step faster than two of speed 1 and slower than two of speed 2
    assert chosen((2.0, 2.0))[2].predicted_s < report.predicted_s < alike_report.predicted_s


def test_rank_speeds_declared_or_by_kind(no_probe):
    cpu = _ranks([0, 0])
    gpus = [dict(cpu[0], kind="old gpu", fp32=1e12), dict(cpu[1], kind="new gpu", fp32=3e12)]

    def declared(speeds: str, *more: str):
        return tiny_config("parallel.dp=2", f"runtime.device_speeds={speeds}", *more)
    # relative to emulate_flops, where the profile runs
    assert rank_speeds(declared("[4.0, 2.0]", "runtime.emulate_flops=1e9"), cpu) == (4.0, 2.0)
    assert rank_speeds(declared("[4.0, 2.0]"), cpu) == (2.0, 1.0)  # real devices: to the slowest, the profile's
    assert rank_speeds(declared("[1.0, 1.0]", "runtime.emulate_flops=1e9"), cpu) == ()
    assert rank_speeds(tiny_config(), cpu) == ()  # one kind, undeclared: alike
    assert rank_speeds(tiny_config(), gpus) == (1.0, 3.0)  # kinds differ: their measured matmuls
