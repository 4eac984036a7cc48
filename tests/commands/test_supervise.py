"""Signals to the launcher stop the whole run and leave no process behind.

A process tree like torchrun's (children in sessions of their own, one that
ignores SIGTERM) under the Supervisor, then `tessel train` itself: SIGTERM,
SIGHUP and SIGINT to the launcher, with and without the heartbeat, stop every
rank after a preemption checkpoint that resumes on the uninterrupted run's
trajectory bit for bit.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from tessel.commands.supervise import descendants
from tests.helpers import ROOT, cli_env, metrics_rows, train_command, write_recipe

STEPS = 40


def tagged_pids(tag: str) -> list[int]:
    """Live processes whose environment carries TESSEL_TEST_TAG=tag (zombies have no environment)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if f"TESSEL_TEST_TAG={tag}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
        except OSError:
            continue
    return [p for p in found if p != os.getpid()]


def kill_tagged(tag: str) -> None:
    """Clean-up after a failed test: nothing of it may outlive it."""
    for pid in tagged_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture
def tag():
    """A tag for this test's processes (in their environment), and a clean-up should the test fail."""
    value = uuid.uuid4().hex
    yield value
    kill_tagged(value)


def assert_none_left(tag: str, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert tagged_pids(tag) == [], f"processes left behind: {tagged_pids(tag)}"


# ---- the supervisor on a plain process tree ------------------------------------------------------
TREE = textwrap.dedent("""
    import signal, subprocess, sys, time
    # like torchrun: workers in sessions of their own; one of them ignores SIGTERM
    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    kids = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
            for code in ("import time; time.sleep(600)", stubborn)]
    print("ready", flush=True)
    time.sleep(600)
""")

SUPERVISED = textwrap.dedent("""
    import os, sys
    from tessel.commands.supervise import Supervisor
    from tessel.train.fault.preempt import ControlDir
    control = ControlDir.create()
    code = Supervisor([sys.executable, "-c", sys.argv[1]], dict(os.environ), control, grace_s=1.0).run()
    control.remove()
    sys.exit(code)
""")


def test_descendants_walks_the_process_tree():
    proc = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                             "time.sleep(30)"])
    try:
        deadline = time.monotonic() + 10
        while len(descendants(proc.pid)) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        below = descendants(os.getpid())
        assert proc.pid in below and set(descendants(proc.pid)) < set(below)
    finally:
        for pid in descendants(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_supervisor_stops_a_tree_of_other_sessions_and_kills_what_ignores_it(sig, tag):
    env = {**os.environ, "TESSEL_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", SUPERVISED, TREE], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    time.sleep(0.3)  # the workers are up
    assert len(tagged_pids(tag)) == 4  # supervisor, child, 2 workers
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=20)
    # the child exits on the signal; the stubborn worker ignores SIGTERM and is killed after the 1 s grace
    assert proc.returncode == 128 + sig, err
    assert f"{signal.Signals(sig).name}: stopping the run" in err
    assert_none_left(tag)


def test_orphans_of_a_dead_child_are_killed_when_it_exits(tag):
    env = {**os.environ, "TESSEL_TEST_TAG": tag, "PYTHONPATH": str(ROOT)}
    orphaning = TREE.replace("time.sleep(600)\n", "sys.exit(3)\n").replace('print("ready", flush=True)', "")
    proc = subprocess.run([sys.executable, "-c", SUPERVISED, orphaning], env=env, capture_output=True,
                          text=True, timeout=30)
    assert proc.returncode == 3, proc.stderr  # the child's own code
    assert_none_left(tag)


# ---- tessel train ----------------------------------------------------------------------------------
def _recipe(tmp: Path) -> Path:
    return write_recipe(tmp / "recipe.toml", "parallel.dp=2", f"train.steps={STEPS}", "checkpoint.every=1000",
                        "runtime.timeout_s=60")


def _train_cmd(recipe: Path, out: Path, *args: str) -> list[str]:
    return train_command(recipe, out, *args)


def _env(tag: str, **extra: str) -> dict[str, str]:
    return cli_env(TESSEL_TEST_TAG=tag, **extra)


def _wait_for_steps(out: Path, proc: subprocess.Popen, steps: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    path = out / "metrics.jsonl"
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        if path.exists() and len(path.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {steps} steps within {timeout}s")


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("sigref")
    out = tmp / "run"
    proc = subprocess.run(_train_cmd(_recipe(tmp), out), env=_env("ref"), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["step"]: r["loss"] for r in metrics_rows(out)}


@pytest.mark.parametrize("sig,heartbeat", [(signal.SIGTERM, 2.0), (signal.SIGHUP, 2.0), (signal.SIGINT, 0.0)],
                         ids=["SIGTERM", "SIGHUP", "SIGINT-no-heartbeat"])
def test_signal_to_launcher_stops_every_rank_after_a_checkpoint_that_resumes_exactly(
        reference, tmp_path, sig, heartbeat, tag):
    recipe, out = _recipe(tmp_path), tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(recipe, out, "--set", f"fault.heartbeat_s={heartbeat}"), env=_env(tag),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _wait_for_steps(out, proc, 3)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + sig, stderr[-3000:]
    assert_none_left(tag)
    done = len(metrics_rows(out))
    assert 3 <= done < STEPS
    assert (out / "checkpoints" / f"step_{done:08d}").is_dir(), stderr[-3000:]
    assert f"stopped by {signal.Signals(sig).name} after step {done}" in stderr
    assert not (out / ".tessel.lock").exists()  # the launcher let go of the folder
    # the preemption checkpoint holds the state after `done` steps: the rest of the run is the reference's
    resumed = subprocess.run(_train_cmd(recipe, out, "--resume", "auto"), env=_env(tag), capture_output=True,
                             text=True, timeout=300, cwd=ROOT)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = {r["step"]: r["loss"] for r in metrics_rows(out)}
    assert sorted(got) == list(range(STEPS))
    for step in range(STEPS):  # same layout and checkpointed bits: bitwise the same
        assert got[step] == reference[step], f"step {step}: {got[step]} != {reference[step]}"


def test_second_sigint_kills_at_once(tmp_path, tag):
    recipe, out = _recipe(tmp_path), tmp_path / "run"
    # rank 1 spends a minute in step 3's forward: a graceful stop would wait for it
    proc = subprocess.Popen(_train_cmd(recipe, out, "--set", "checkpoint.every=0"),
                            env=_env(tag, TESSEL_FAULT="slow:rank=1:step=3:seconds=60"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    _wait_for_steps(out, proc, 3)
    proc.send_signal(signal.SIGINT)
    for line in proc.stderr:
        if "SIGINT: stopping the run" in line:
            break
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    stderr = proc.stderr.read()
    proc.wait(timeout=60)
    assert time.monotonic() - t0 < 15  # not the minute the slow rank would take
    assert proc.returncode == 128 + signal.SIGINT
    assert "second SIGINT: killing the run now" in stderr, stderr[-2000:]
    assert_none_left(tag)


def test_sigkill_of_the_launcher_still_stops_the_ranks(tmp_path, tag):
    """The one signal the launcher cannot handle: torchrun gets SIGTERM when it dies (PDEATHSIG)."""
    recipe, out = _recipe(tmp_path), tmp_path / "run"
    proc = subprocess.Popen(_train_cmd(recipe, out, "--set", "train.steps=100000"), env=_env(tag),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
    _wait_for_steps(out, proc, 2)
    proc.kill()
    proc.wait()
    assert_none_left(tag, within_s=60)
