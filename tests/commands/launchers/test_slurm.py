"""`tessel launch slurm` on a real Slurm (a private slurmctld and two slurmd on this machine): a 2-node job
trains, is requeued (Slurm's preemption path), then stopped near its time limit (the script requeues itself),
and finishes on the loss trajectory of an uninterrupted run."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers import cli_env, write_recipe
from tests.commands.launchers.local_slurm import LocalSlurm, why_not

STEPS = 300  # short steps: each interruption lands mid-run


def _losses(out: Path) -> dict[int, float]:
    """The loss of every step; a resumed attempt re-logs the steps it replays, the last row counts."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _wait_for_step(out: Path, step: int, slurm: LocalSlurm, job: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and path.read_text().count("\n") and max(_losses(out)) >= step:
            return
        assert slurm.job_state(job)[0] in ("RUNNING", "PENDING", "CONFIGURING"), slurm.logs()
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached in {timeout} s:\n{slurm.logs()}")


@pytest.mark.skipif(why_not() is not None, reason=str(why_not()))
def test_two_node_job_is_requeued_twice_and_resumes_on_the_same_trajectory(tmp_path):
    recipe = write_recipe(tmp_path / "tiny.toml", "parallel.dp=2", f"train.steps={STEPS}", "train.eval_every=0",
                          "checkpoint.every=1000", "fault.heartbeat_s=0")
    out = tmp_path / "run"
    script = tmp_path / "job" / "tslm.sbatch"
    ref = tmp_path / "ref"  # the uninterrupted run, beside the job: most of the job's time is waiting
    uninterrupted = subprocess.Popen([sys.executable, "-m", "tessel", "train", str(recipe), "--set",
                                      f'logging.out_dir="{ref}"'], env=cli_env(), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
    try:
        _requeued_twice(recipe, out, script, tmp_path)
        log, _ = uninterrupted.communicate(timeout=240)
    finally:
        if uninterrupted.poll() is None:
            uninterrupted.kill()
            uninterrupted.wait()
    assert uninterrupted.returncode == 0, log[-3000:]
    got, want = _losses(out), _losses(ref)
    assert sorted(got) == list(range(STEPS))
    # the same arithmetic in the same order: dp=2 all-reduces two numbers, whichever machine adds them
    assert all(got[s] == want[s] for s in range(STEPS)), [(s, got[s], want[s]) for s in range(STEPS)
                                                         if got[s] != want[s]][:5]


def _requeued_twice(recipe: Path, out: Path, script: Path, tmp_path: Path) -> None:
    """Submit, requeue (Slurm's preemption path), stop near the time limit (the script's path), finish."""
    with LocalSlurm(nodes=2) as slurm:
        env = cli_env(SLURM_CONF=str(slurm.conf))
        launch = subprocess.run(
            [sys.executable, "-m", "tessel", "launch", "slurm", str(recipe), "--nodes", "2", "--procs-per-node", "1",
             "--time", "10", "--grace", "30", "--job-name", "tslm", "--out", str(script), "--submit",
             "--set", f'logging.out_dir="{out}"'], env=env, capture_output=True, text=True, timeout=120)
        assert launch.returncode == 0, launch.stderr
        job = launch.stdout.split("submitted job ")[1].split()[0]
        text = script.read_text()
        for directive in ("--nodes=2", "--ntasks-per-node=1", "--requeue", "--signal=B:USR1@30", "--time=10"):
            assert f"#SBATCH {directive}\n" in text

        # 1. Slurm's own preemption path: `scontrol requeue` sends SIGTERM to every process of the job
        _wait_for_step(out, 3, slurm, job)
        slurm.run("scontrol", "requeue", job)
        assert slurm.wait_state(job, {"PENDING"}) == "PENDING"
        first = max(_losses(out))
        assert first < STEPS - 1, "the run ended before the requeue reached it"
        slurm.release(job)  # a requeued job waits two minutes (BeginTime) by Slurm's rule

        # 2. the time limit's path: USR1 to the script, which stops the ranks and requeues the job itself
        _wait_for_step(out, first + 4, slurm, job)
        slurm.run("scancel", "--batch", "--signal=USR1", job)
        deadline = time.monotonic() + 120
        while slurm.job_state(job) != ("PENDING", "BeginTime") and time.monotonic() < deadline:
            time.sleep(0.1)
        second = max(_losses(out))
        assert first + 4 <= second < STEPS - 1
        slurm.release(job)
        assert slurm.wait_state(job, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=180) == "COMPLETED", slurm.logs()
        info = slurm.run("scontrol", "show", "job", job, "-o").stdout
        assert "Restarts=2" in info and "ExitCode=0:0" in info, info

        logs = script.parent / "logs"
        batch = (logs / f"tslm-{job}.out").read_text()
        nodes = [(logs / f"tslm-{job}-node{k}.out").read_text() for k in range(2)]
    left = slurm.ours()
    assert left == [], f"processes of the test's Slurm still running: {left}"

    assert [f"attempt {k}" in batch for k in (1, 2, 3)] == [True] * 3, batch
    assert "time limit in 30 s or less" in batch
    ranks = "".join(nodes)  # rank 0 is on whichever node joined the rendezvous first
    for step in (first + 1, second + 1):  # each attempt saved after the step it stopped at
        assert f"stopped by SIGTERM after step {step}" in ranks, ranks[-3000:]
    assert all("[tessel] rank" in n for n in nodes)  # both nodes' ranks got the signal
