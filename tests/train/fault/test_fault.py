"""Faults end to end: a killed rank, a stopped rank, a shrinking world, NaNs, stragglers.

The CLI runs (`python -m tessel train` under torchrun) share one uninterrupted
4-rank reference run; every faulty run must land on its trajectory.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tessel.spawn import spawn
from tessel.elastic.dp_only import replan
from tessel.train.fault.injection import parse_faults
from tessel.train.fault.stragglers import straggler_report
from tests.helpers import ROOT, build_trainer, cli_env, metrics_rows, tiny_config, train_command, write_recipe

STEPS = 8
HANG_TIMEOUT_S = 4.0
HEARTBEAT_S = 0.5
RECIPE = ["parallel.dp=4", f"train.steps={STEPS}", "checkpoint.every=2", "checkpoint.keep=10",
          f"fault.heartbeat_s={HEARTBEAT_S}", f"fault.hang_timeout_s={HANG_TIMEOUT_S}", "fault.straggler_every=1",
          "fault.straggler_factor=3.0", "fault.straggler_min_s=0.3", "runtime.timeout_s=60"]


def tessel_train(out: Path, *args: str, fault: str = "") -> subprocess.CompletedProcess:
    recipe = write_recipe(out.parent / "recipe.toml", *RECIPE)
    proc = subprocess.run(train_command(recipe, out, *args), env=cli_env(TESSEL_FAULT=fault), capture_output=True,
                          text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def losses_by_step(out: Path) -> dict[int, float]:
    """The last logged loss of every step (a resumed attempt re-logs the steps it replays)."""
    rows = metrics_rows(out)
    return {r["step"]: r["loss"] for r in rows}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "run"
    tessel_train(out)
    return out


def test_killed_and_stopped_ranks_restart_on_the_same_trajectory(reference, tmp_path):
    rng = random.Random()
    killed = rng.randrange(4)
    stopped = rng.choice([r for r in range(4) if r != killed])
    out = tmp_path / "run"
    proc = tessel_train(out, "--max-restarts", "2", "--resume", "auto",
                        fault=f"kill:rank={killed}:step=3,stop:rank={stopped}:step=6")
    log = proc.stderr + proc.stdout
    assert f"injecting kill on rank {killed} at step 3" in log
    assert f"injecting stop on rank {stopped} at step 6" in log
    # the stalled rank is named, with what it was doing, within the configured timeout
    m = re.search(rf"rank {stopped} \(pid \d+ on \S+\) is stalled: no heartbeat for ([\d.]+)s.*step (\d+)", log)
    assert m, log[-4000:]
    # the watchdog looks every heartbeat period; 1 s more for thread scheduling on a loaded machine
    assert float(m.group(1)) <= HANG_TIMEOUT_S + HEARTBEAT_S + 1.0 and int(m.group(2)) == 6
    assert "resumed from" in log and "step_00000002" in log and "step_00000006" in log
    ref, got = losses_by_step(reference), losses_by_step(out)
    assert sorted(got) == list(range(STEPS))
    # same layout, same checkpointed bits, same reduction order: the restarted run is bitwise the same
    for step in range(STEPS):
        assert got[step] == ref[step], f"step {step}: {got[step]} != {ref[step]} (killed {killed}, stopped {stopped})"


def test_elastic_4_to_2_ranks_keeps_global_batch_and_trajectory(reference, tmp_path):
    out = tmp_path / "run"
    ckpts = out / "checkpoints"
    shutil.copytree(reference / "checkpoints", ckpts)
    for d in ckpts.iterdir():
        if d.name > "step_00000004":
            shutil.rmtree(d)  # the 4-rank run "died" after its step-4 checkpoint
    proc = tessel_train(out, "--nproc-per-node", "2", "--resume", "auto", fault="slow:rank=1:step=5:seconds=0.8")
    log = proc.stderr + proc.stdout
    assert "world 4 -> 2: dp 4 -> 2, grad_accum 1 -> 2, global batch 8 kept" in log
    assert "(saved by 4 ranks, dp=4" in log
    ref, got = losses_by_step(reference), losses_by_step(out)
    assert sorted(got) == list(range(4, STEPS))
    # dp2 x accum2 sums the same 8 sequences' gradients in another order than dp4:
    # fp32 ulps per step (measured < 1e-6), compounding over 4 AdamW steps
    assert_close(torch.tensor([got[s] for s in range(4, STEPS)]), torch.tensor([ref[s] for s in range(4, STEPS)]),
                 rtol=1e-5, atol=1e-5)
    # the injected straggler is named, as a warning and as a metric
    assert re.search(r"step 5: rank 1 is a straggler", log), log[-3000:]
    rows = {r["step"]: r for r in metrics_rows(out)}
    assert rows[5]["straggler_rank"] == 1 and rows[6]["straggler_rank"] == -1


# ---- numerical faults (in-process ranks) ---------------------------------------------------
def _nan_run(root: str, fault: str) -> dict:
    os.environ["TESSEL_FAULT"] = fault
    cfg = tiny_config("parallel.dp=2", "train.steps=8", "fault.heartbeat_s=0", "fault.nan_tolerance=2",
                      "checkpoint.every=4",
                      f'checkpoint.dir="{root}"', f'logging.out_dir="{root}/logs"')
    trainer, model, _, _ = build_trainer(cfg)
    trainer.fit()
    return {"rows": [(r["loss"], r["skipped"], r.get("rolled_back_to")) for r in trainer.history],
            "weights": {k: v.clone() for k, v in model.state_dict().items()}}


def _nan_pair(root: str) -> tuple[dict, dict]:
    # rank 1 alone gets the NaN gradient: both ranks must skip
    once = _nan_run(f"{root}/once", "nan:rank=1:step=2:count=1")
    streak = _nan_run(f"{root}/streak", "nan:rank=1:step=2:count=1,nan:rank=1:step=5:count=2")
    return once, streak


def test_nan_skips_on_all_ranks_then_rolls_back(tmp_path):
    (once0, streak0), (once1, streak1) = spawn(_nan_pair, 2, str(tmp_path))
    for once, streak in ((once0, streak0), (once1, streak1)):
        assert [s for _, s, _ in once["rows"]] == [i == 2 for i in range(8)]
        # steps 5 and 6 skipped -> rollback to the step-4 checkpoint, then 4..7 replayed
        skipped = [i for i, (_, s, _) in enumerate(streak["rows"]) if s]
        assert skipped == [2, 5, 6] and streak["rows"][6][2] == 4
        assert len(streak["rows"]) == 8 + 3
        # the replayed steps land exactly where the run with the single skip went
        assert [loss for loss, _, _ in streak["rows"][7:]] == [loss for loss, _, _ in once["rows"][4:]]
    for k, v in once0["weights"].items():
        assert torch.equal(v, once1["weights"][k]) and torch.equal(v, streak0["weights"][k])
        assert torch.isfinite(v).all()


# ---- pure logic ----------------------------------------------------------------------------
def test_replan_keeps_global_batch_and_micro_batch():
    cfg = tiny_config("parallel.dp=4")
    two = replan(cfg, 2)
    assert (two.parallel.dp, two.train.grad_accum, two.train.global_batch) == (2, 2, 8)
    one = replan(cfg, 1)
    assert (one.parallel.dp, one.train.grad_accum) == (1, 4)
    assert replan(two, 4).train.grad_accum == 1


def test_straggler_report_names_the_slow_rank():
    rep = straggler_report([0.10, 0.11, 0.52, 0.10], factor=3.0, min_gap_s=0.3)
    assert rep["straggler_rank"] == 2 and rep["straggler_ratio"] > 4
    assert straggler_report([0.10, 0.11, 0.12, 0.10], 3.0, 0.3)["straggler_rank"] == -1


def test_fault_spec_parsing():
    faults = parse_faults("kill:rank=2:step=5,slow:rank=1:step=2:seconds=0.5")
    assert [(f.kind, f.rank, f.step) for f in faults] == [("kill", 2, 5), ("slow", 1, 2)]
    assert faults[1].seconds == 0.5
    with pytest.raises(ValueError, match="unknown fault kind"):
        parse_faults("explode:rank=0")
