"""fault.slow_policy: a rank slowed 3x from step 3 is named within the window; rebalance gives it less of the
batch and the step recovers to the ideal for the capacity left; evict goes on without it, re-planned: without its
whole node where the job has several, without the rank alone where its node is the whole job.

Ranks on emulated devices (tessel.models.emulated), so that compute, not the 2 shared cores, sets the step;
TESSEL_FAULT's slow:...:factor=3 makes a rank's forward and backward take 3x as long from step 3 on. One
node: three ranks (dp3, 21 sequences a step, 7 micro-batches each); one spawn runs the rebalance run, then
the evict run (which leaves rank 2 out of the process group). Two nodes of 2 ranks: rank 3 is slowed and
node 1 leaves; ranks 0 and 1 (speeds 1 and 2) go on, re-planned in full for their speeds.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import statistics

import torch
from torch.testing import assert_close

from tessel.elastic.adaptive import run_layouts
from tessel.planner.hetero import proportional_shares
from tessel.spawn import spawn
from tessel.train.fault.slow import SlowRanks
from tests.helpers import build_trainer, metrics_rows, tiny_config

STEPS, SLOW_FROM, WINDOW = 10, 3, 3
BASE = ["parallel.dp=3", "train.global_batch=21", "train.grad_accum=7", f"train.steps={STEPS}", "train.lr=1e-3",
        "runtime.emulate_flops=1e8",  # a micro-batch (16 tokens, 2 blocks) waits ~26 ms: more than it computes
        f"fault.slow_window={WINDOW}", "fault.slow_factor=2.0", "fault.straggler_every=0"]


def _run(root: str, policy: str, *more: str) -> dict:
    os.environ["TESSEL_FAULT"] = f"slow:rank=2:step={SLOW_FROM}:factor=3:count=1000"
    os.environ["TESSEL_FAULT_DIR"] = f"{root}/faults"
    cfg = tiny_config(*BASE, f'fault.slow_policy="{policy}"', *more, out_dir=f"{root}/{policy}")
    summary = run_layouts(cfg, torch.device("cpu"))
    return {"losses": None if summary is None else summary.losses, "world": torch.distributed.get_world_size()}


def _both(root: str) -> dict:
    rebalance = _run(root, "rebalance", "fault.heartbeat_s=0")
    evict = _run(root, "evict", 'fault.replan="dp-only"', "fault.heartbeat_s=0.5", "fault.hang_timeout_s=60")
    return {"rebalance": rebalance, "evict": evict}


def test_slow_rank_is_named_then_rebalanced_or_evicted(tmp_path):
    os.environ["TESSEL_CACHE"] = str(tmp_path / "cache")  # the evict run's full re-plan profiles the model
    got = spawn(_both, 3, str(tmp_path), timeout=600, env={"TESSEL_CACHE": str(tmp_path / "cache")})
    rows = {policy: {r["step"]: r for r in metrics_rows(tmp_path / policy)} for policy in ("rebalance", "evict")}
    for policy, by_step in rows.items():
        named = [s for s, r in by_step.items() if r.get("slow_rank") is not None]
        # named once, within the window of slowed steps (3, 4, 5): as soon as it is the slowest in most of
        # the window's steps and their median shows it
        assert len(named) == 1 and SLOW_FROM <= named[0] < SLOW_FROM + WINDOW, (policy, named)
        assert by_step[named[0]]["slow_rank"] == 2 and by_step[named[0]]["slow_ratio"] > 2
        assert sorted(by_step) == list(range(STEPS))
    moved = named[0] + 1  # both runs went on from a checkpoint of the step after
    r = rows["rebalance"]
    before = statistics.median(r[s]["step_time_s"] for s in (1, 2))
    slowed = statistics.median(r[s]["step_time_s"] for s in range(SLOW_FROM, moved))
    after = statistics.median(r[s]["step_time_s"] for s in range(moved + 1, STEPS))  # after a warm-up step
    # the capacity left is 1 + 1 + 1/3 of 3 devices: at best the step takes 3 / (7/3) = 1.29x as long,
    # shares [9, 9, 3] realise it exactly; the even split is bound by the slow rank's 7 micro-batches at 3x
    ideal = before * 3 / (7 / 3)
    assert slowed > 2 * before, (before, slowed)
    assert after <= 1.2 * ideal, (before, slowed, after, ideal)
    # evict: rank 2 left; ranks 0 and 1 went on from the checkpoint. 21 sequences do not split over dp2,
    # so dp-only could not continue and the whole layout was chosen again for 2 ranks (tp2 or pp2)
    assert got[2]["evict"]["losses"] is None and got[0]["evict"]["world"] == 2
    assert len(got[0]["evict"]["losses"]) == STEPS - moved
    # every run sums the same 21 sequences' gradients in its own order (dp3 even, [9, 9, 3] weighted,
    # tp2 or pp2): fp32 rounding, compounding over 10 AdamW steps at lr 1e-3 (measured < 1e-6)
    losses = {p: [rows[p][s]["loss"] for s in range(STEPS)] for p in rows}
    assert_close(torch.tensor(losses["evict"]), torch.tensor(losses["rebalance"]), rtol=1e-5, atol=1e-5)


def test_the_window_needs_a_persistent_slowest_rank():
    from tessel.config import FaultConfig
    slow = SlowRanks(FaultConfig(slow_window=3, slow_factor=1.5))
    assert slow.observe(0, [0.1, 0.1, 0.5], 1.0) is None  # one slow step is not enough
    assert slow.observe(1, [0.1, 0.5, 0.1], 1.0) is None
    assert slow.observe(2, [0.1, 0.1, 0.1], 1.0) is None  # three different slowest ranks: nobody
    assert slow.observe(3, [0.1, 0.1, 0.3], 1.0) is None  # slowest once in three: not yet
    found = slow.observe(4, [0.1, 0.12, 0.31], 1.0)  # twice, and the window's median shows it
    assert found.rank == 2 and found.steps == (2, 4) and found.ratio > 2.5
    assert found.idle_s[0] > found.idle_s[2]  # the fast ranks wait for it
    assert slow.observe(5, [0.1, 0.1, 0.3], 1.0) is None  # the window starts again after a decision
    assert SlowRanks(FaultConfig(slow_window=2)).observe(0, [0.1], 1.0) is None  # one rank: nobody to compare


# ---- two nodes: the slow rank's node leaves -------------------------------------------------------
NODES = ["parallel.dp=4", "train.global_batch=8", "train.grad_accum=2", f"train.steps={STEPS}", "train.lr=1e-3",
         "runtime.emulate_flops=1e8", "runtime.nnodes=2", "runtime.nproc_per_node=2",
         "runtime.device_speeds=[1.0, 2.0, 1.0, 1.0]", 'fault.slow_policy="evict"', 'fault.replan="full"',
         f"fault.slow_window={WINDOW}", "fault.slow_factor=2.0", "fault.straggler_every=0",
         "fault.heartbeat_s=0.5", "fault.hang_timeout_s=60"]


def _node_run(root: str) -> dict:
    os.environ["TESSEL_FAULT"] = f"slow:rank=3:step={SLOW_FROM}:factor=3:count=1000"
    os.environ["TESSEL_FAULT_DIR"] = f"{root}/faults"
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        summary = run_layouts(tiny_config(*NODES, out_dir=f"{root}/nodes"), torch.device("cpu"))
    return {"losses": None if summary is None else summary.losses, "world": torch.distributed.get_world_size(),
            "log": out.getvalue() + err.getvalue()}


def test_evict_takes_the_slow_ranks_node_and_replans_for_the_ranks_left(tmp_path):
    got = spawn(_node_run, 4, str(tmp_path), timeout=600, env={"TESSEL_CACHE": str(tmp_path / "cache")})
    rows = {r["step"]: r for r in metrics_rows(tmp_path / "nodes")}
    named = [s for s, r in rows.items() if r.get("slow_rank") is not None]
    assert len(named) == 1 and SLOW_FROM <= named[0] < SLOW_FROM + WINDOW and rows[named[0]]["slow_rank"] == 3
    log = got[0]["log"]
    assert "policy evict: node 1 (ranks 2, 3, with slow rank 3) leave" in log, log[-3000:]
    # node 1 left whole (rank 2 was not slow); node 0's ranks went on as a world of 2
    assert got[2]["losses"] is None and got[3]["losses"] is None
    assert got[0]["world"] == got[1]["world"] == 2 and sorted(rows) == list(range(STEPS))
    # re-planned for the 2 ranks left at their own speeds (1 and 2): the split in proportion to speed
    report = log[log.index("[tessel replan] full: world 4 -> 2"):]
    assert re.search(r"new  dp2 .*dp by speed\s+2 ranks, predicted", report), report[:2000]
    shares = re.search(r"devices of speeds 1, 2: .*micro-batches per dp rank \[(\d+), (\d+)\]", report)
    assert shares, report
    shares = [int(n) for n in shares.groups()]
    assert shares == proportional_shares([1.0, 2.0], sum(shares)) and shares[1] > shares[0]
    # the losses after the eviction are those of one process on the same 8 sequences a step, from the
    # checkpoint the eviction left: every layout sums them in its own order, and the [3, 5] split weights
    # each rank's loss by its share (tessel.parallel.data.uneven): fp32 rounding over 4 AdamW steps
    moved = named[0] + 1
    ref_cfg = tiny_config(f"train.steps={STEPS}", "train.grad_accum=8", "train.lr=1e-3", "fault.heartbeat_s=0",
                          f'checkpoint.resume="{tmp_path}/nodes/checkpoints/step_{moved:08d}"',
                          out_dir=str(tmp_path / "ref"))
    ref = build_trainer(ref_cfg)[0].fit().losses
    assert_close(torch.tensor(got[0]["losses"]), torch.tensor(ref), rtol=1e-5, atol=1e-5)
