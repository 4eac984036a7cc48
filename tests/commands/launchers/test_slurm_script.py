"""The sbatch script `tessel launch slurm` writes (its text, its shell syntax), Slurm's time formats, and the
out_dir lock a requeued attempt takes over from the attempt before it, wherever that ran."""

import json
import subprocess

import pytest

from tessel.config import ConfigError
from tessel.commands.launchers.job import check_job
from tessel.commands.launchers.slurm import SlurmOptions, time_limit_s, write
from tessel.train.run_dir import LOCK, OutDirLock
from tests.helpers import tiny_config


@pytest.mark.parametrize("text,seconds", [("30", 1800), ("5:30", 330), ("2:00:00", 7200), ("1-0", 86400),
                                          ("1-2:3", 93780), ("0-0:0:90", 90), ("UNLIMITED", None)])
def test_slurm_time_formats(text, seconds):
    assert time_limit_s(text) == seconds


def test_gpu_script_asks_for_the_allocation_and_checkpoints_before_the_time_limit(tmp_path):
    cfg = tiny_config("parallel.dp=8", "checkpoint.every=50", "train.global_batch=8")
    job = check_job(cfg, nodes=2, gpus_per_node=4, procs_per_node=None, grace_s=90)
    assert (job.cfg.runtime.nnodes, job.cfg.runtime.nproc_per_node) == (2, 4)
    opts = SlurmOptions(job_name="big", partition="gpu", time="1-00:00:00", account="proj", extra=["--qos=high"])
    script = write(job, opts, tmp_path / "job" / "big.sbatch", tmp_path)
    text = script.read_text()
    for line in ("--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=4", "--partition=gpu", "--account=proj",
                 "--time=1-00:00:00", "--requeue", "--signal=B:USR1@90", "--open-mode=append", "--qos=high",
                 f"--output={tmp_path}/job/logs/%x-%j.out", f"--chdir={tmp_path}"):
        assert f"#SBATCH {line}\n" in text
    assert "--cpus-per-task" not in text  # a GPU node's CPUs are the site's to give
    flat = text.replace(" \\\n      ", " ")  # the torchrun line, unwrapped
    assert "--rdzv-endpoint=$rdzv_endpoint --rdzv-id=$SLURM_JOB_ID" in flat
    assert f"-m tessel train {tmp_path}/job/big.toml --resume auto &" in flat
    assert "--output=" + str(tmp_path / "job" / "logs") + "/%x-%j-node%n.out" in text
    assert "--nnodes=2 --nproc-per-node=4" in flat and "--shutdown-timeout=90" in flat
    assert "scancel --signal=TERM" in text and 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0  # it parses
    frozen = (tmp_path / "job" / "big.toml").read_text()
    assert "nproc_per_node = 4" in frozen and "resume" not in frozen


def test_untimed_cpu_script_has_no_time_limit_trap(tmp_path):
    job = check_job(tiny_config("parallel.dp=4", "checkpoint.every=5", "runtime.threads_per_rank=2"),
                    nodes=2, gpus_per_node=None, procs_per_node=2, grace_s=30)
    text = write(job, SlurmOptions(requeue=False), tmp_path / "t.sbatch", tmp_path).read_text()
    assert "#SBATCH --cpus-per-task=4\n" in text and "OMP_NUM_THREADS=2" in text
    assert "--signal" not in text and "--requeue" not in text and "on_time_limit" not in text
    with pytest.raises(ConfigError, match="recipe's layout needs 4"):
        check_job(job.cfg, nodes=4, gpus_per_node=None, procs_per_node=2, grace_s=30)


def test_a_requeued_attempt_takes_over_the_lock_of_the_attempt_before_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    earlier = {"host": "node-a", "pid": 1, "run_id": "r", "slurm_job": "77", "slurm_attempt": 0}
    (tmp_path / LOCK).write_text(json.dumps(earlier))  # another host: alive as far as we can tell
    lock = OutDirLock(tmp_path, say=lambda _m: None)
    lock.acquire("r")
    assert json.loads((tmp_path / LOCK).read_text())["slurm_attempt"] == 1
    lock.release()
    other_job = {**earlier, "slurm_job": "78"}  # another job's live lock is never taken
    (tmp_path / LOCK).write_text(json.dumps(other_job))
    with pytest.raises(ConfigError, match="in use by run r"):
        OutDirLock(tmp_path).acquire("r")
