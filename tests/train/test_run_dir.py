"""One run per output folder: the lock, the run's identity, fresh vs resumed vs overwritten; finished runs.

Unit tests of tessel.train.run_dir, then `tessel train` twice on one folder,
one after the other and at once, and the resume of a finished run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessel.config import ConfigError
from tessel.train.run_dir import LOCK, OutDirLock, claim, read_run_id
from tests.helpers import ROOT, cli_env, metrics_rows, tiny_config, train_command, write_recipe


def _cfg(out: Path, *overrides: str):
    return tiny_config(f'logging.out_dir="{out}"', *overrides)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid  # reaped: no such process (pids are not reused this quickly)


def test_lock_is_exclusive_and_released(tmp_path):
    first = claim(_cfg(tmp_path), resume=False, overwrite=False)
    assert json.loads((tmp_path / LOCK).read_text())["pid"] == os.getpid()
    with pytest.raises(ConfigError, match=r"logging.out_dir: .* is in use by run .*pid \d+"):
        OutDirLock(tmp_path).acquire("other")
    first.release()
    assert not (tmp_path / LOCK).exists()
    OutDirLock(tmp_path).acquire("other")  # free again


def test_stale_lock_of_a_dead_process_is_taken_over_with_a_message(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"host": os.uname().nodename, "pid": _dead_pid(), "run_id": "old"}))
    said = []
    lock = OutDirLock(tmp_path, say=said.append)
    lock.acquire("new")
    assert lock.held and "taking over the stale lock" in said[0]


def test_lock_of_another_host_is_not_taken(tmp_path):
    (tmp_path / LOCK).write_text(json.dumps({"host": "elsewhere", "pid": _dead_pid(), "run_id": "old"}))
    with pytest.raises(ConfigError, match="in use by run old .* on elsewhere"):
        OutDirLock(tmp_path).acquire("new")


def test_fresh_run_refuses_a_folder_with_another_runs_files(tmp_path):
    first = claim(_cfg(tmp_path), resume=False, overwrite=False)
    first.release()
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "loss": 1.0}\n')
    (tmp_path / "checkpoints" / "step_00000002").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"holds the files of run .*--resume auto.*--overwrite"):
        claim(_cfg(tmp_path), resume=False, overwrite=False)
    assert not (tmp_path / LOCK).exists()  # a refused claim leaves no lock behind
    # resuming continues the run that lives here
    again = claim(_cfg(tmp_path), resume=True, overwrite=False)
    assert again.run_id == first.run_id
    again.release()
    # --overwrite removes exactly the old run's files and starts a new run
    (tmp_path / "notes.txt").write_text("mine")
    new = claim(_cfg(tmp_path), resume=False, overwrite=True)
    assert new.run_id != first.run_id and read_run_id(tmp_path) == new.run_id
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoints" / "step_00000002").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    new.release()


def test_unusable_folders_are_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="logging.out_dir: .* is a file"):
        claim(_cfg(tmp_path / "file"), resume=False, overwrite=False)
    with pytest.raises(ConfigError, match="checkpoint.dir: .* is a file"):
        claim(_cfg(tmp_path / "run", f'checkpoint.dir="{tmp_path / "file"}"', "checkpoint.every=2"),
              resume=False, overwrite=False)


@pytest.mark.skipif(os.geteuid() != 0, reason="a read-only mount needs root (as root, permissions allow writing)")
def test_read_only_out_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], check=True)
    try:
        with pytest.raises(ConfigError, match="logging.out_dir: .* is not writable"):
            claim(_cfg(ro), resume=False, overwrite=False)
    finally:
        subprocess.run(["umount", str(ro)], check=True)


# ---- through the CLI ---------------------------------------------------------------------------
def tessel_train(tmp: Path, out: Path, *args: str, wait: bool = True):
    recipe = write_recipe(tmp / "recipe.toml", "parallel.dp=2", "train.steps=6", "checkpoint.every=2",
                          "checkpoint.keep=2", "fault.heartbeat_s=0")
    cmd = train_command(recipe, out, *args)
    if not wait:
        return subprocess.Popen(cmd, env=cli_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                cwd=ROOT)
    return subprocess.run(cmd, env=cli_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_second_run_on_a_folder_is_refused_then_overwrites_or_resumes_a_finished_run(tmp_path):
    out = tmp_path / "run"
    first = tessel_train(tmp_path, out)
    assert first.returncode == 0, first.stderr[-3000:]
    run_id = read_run_id(out)
    ckpts = sorted(d.name for d in (out / "checkpoints").iterdir())
    assert ckpts == ["step_00000004", "step_00000006"]  # keep = 2, its own
    # a fresh run on the same folder: refused before anything starts, nothing touched
    again = tessel_train(tmp_path, out)
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert f"holds the files of run {run_id}" in again.stderr
    assert len(metrics_rows(out)) == 6 and sorted(d.name for d in (out / "checkpoints").iterdir()) == ckpts
    # resuming the finished run: exit 0, a message and the summary, nothing trained
    done = tessel_train(tmp_path, out, "--resume", "auto")
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"run {run_id} is already finished" in done.stdout + done.stderr
    assert "run summary" in done.stdout and len(metrics_rows(out)) == 6
    # --overwrite: a new run replaces the old one's files
    new = tessel_train(tmp_path, out, "--overwrite", "--set", "train.steps=2")
    assert new.returncode == 0, new.stderr[-3000:]
    assert read_run_id(out) != run_id and len(metrics_rows(out)) == 2
    assert sorted(d.name for d in (out / "checkpoints").iterdir()) == ["step_00000002"]


def test_two_runs_at_once_on_one_folder(tmp_path):
    out = tmp_path / "run"
    first = tessel_train(tmp_path, out, "--set", "train.steps=100000", "--set", "checkpoint.every=0", wait=False)
    try:
        deadline = time.monotonic() + 120
        while not (out / "metrics.jsonl").exists() and time.monotonic() < deadline:
            assert first.poll() is None, first.communicate()
            time.sleep(0.1)
        second = tessel_train(tmp_path, out, "--resume", "auto")  # even a resume may not share a live folder
        assert second.returncode == 2, second.stderr[-2000:]
        assert "is in use by run" in second.stderr and f"pid {first.pid}" in second.stderr
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
        assert first.returncode == 128 + signal.SIGTERM
    finally:
        if first.poll() is None:
            first.kill()  # its ranks follow (tessel.commands.supervise: PR_SET_PDEATHSIG)
    steps = [r["step"] for r in metrics_rows(out)]
    assert steps == list(range(len(steps)))  # one writer: no interleaved rows


def test_trainer_resumed_at_the_last_step_returns_the_runs_summary(tmp_path):
    from tests.helpers import build_trainer
    done = build_trainer(_cfg(tmp_path, "train.steps=4", "checkpoint.every=2", "fault.heartbeat_s=0"))[0].fit()
    # a restart after the last checkpoint (e.g. a rank killed in the summary) resumes at train.steps
    trainer = build_trainer(_cfg(tmp_path, "train.steps=4", "checkpoint.every=2", "fault.heartbeat_s=0",
                                 'checkpoint.resume="auto"'))[0]
    summary = trainer.fit()
    assert trainer.history == [] and summary.losses == done.losses and summary.steps == 4


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs (a disk that fills up) needs root")
def test_disk_full_stops_the_run_in_one_line_without_restarts(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    # one checkpoint of this model takes ~700 KB: step 2 fits in 1 MiB, step 4 does not
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        out = tmp_path / "run"
        proc = tessel_train(tmp_path, out, "--max-restarts", "2", "--set", f'checkpoint.dir="{disk}"',
                            "--set", "checkpoint.keep=10")
        assert proc.returncode == 1, proc.stderr[-3000:]
        errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "ENOSPC" in errors[0] and ".tmp-step_00000004" in errors[0], proc.stderr
        assert "Traceback" not in proc.stderr
        assert "resumed from" not in proc.stderr  # no restart repeated the failure
        # step 3's save failed before its row was logged; a resume from step 2 runs steps 2 and 3 again
        assert [r["step"] for r in metrics_rows(out)] == [0, 1, 2]
        assert sorted(d.name for d in disk.iterdir() if d.name.startswith(("step_", ".tmp"))) == ["step_00000002"]
        from tessel.train.checkpoint.manager import verify
        verify(disk / "step_00000002")  # the previous checkpoint is intact
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_resume_path_with_quotes_and_backslashes_travels_as_a_value(tmp_path):
    """--resume used to be pasted into a TOML string: a '"' or '\\' in the path broke it."""
    from tessel.commands.launch import LaunchOptions, preflight
    from tests.helpers import build_trainer
    saved = tmp_path / 'we"ird\\name'
    build_trainer(_cfg(tmp_path / "first", "train.steps=2", "checkpoint.every=2", "fault.heartbeat_s=0",
                       f"checkpoint.dir={json.dumps(str(saved))}"))[0].fit()
    cfg = _cfg(tmp_path / "second", "train.steps=4")
    checked = preflight(cfg, LaunchOptions(resume=str(saved / "step_00000002")))
    assert checked.cfg.checkpoint.resume == str(saved / "step_00000002") and checked.resume_step == 2
