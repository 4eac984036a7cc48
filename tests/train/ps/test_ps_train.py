"""`tessel train` with parallel.dp_arch = "ps": config rules, and BSP training that matches all-reduce DP."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.testing import assert_close

from tessel.config import ConfigError, build_config
from tests.helpers import ROOT, metrics_rows


def ps_config(*overrides: str):
    # a fresh dict each time: overrides write into the nested sections
    return build_config({"parallel": {"dp": 2, "dp_arch": "ps", "ps_servers": 1}}, list(overrides))


@pytest.mark.parametrize("override, field", [
    ("parallel.tp=2", "parallel.tp"),
    ("parallel.pp=2", "parallel.pp"),
    ("parallel.zero_stage=1", "parallel.zero_stage"),
    ("parallel.ps_staleness=2", "parallel.ps_staleness"),  # staleness without ssp
    ("runtime.elastic=true", "runtime.elastic"),
])
def test_ps_layout_rules_name_the_field(override, field):
    with pytest.raises(ConfigError) as err:
        ps_config(override)
    assert err.value.field == field


def test_ps_world_size_counts_the_servers_and_modes_need_ps():
    cfg = ps_config("parallel.ps_servers=2", 'parallel.ps_mode="ssp"', "parallel.ps_staleness=3")
    assert cfg.parallel.world_size == 4  # 2 workers + 2 servers
    assert build_config({}).parallel.world_size == 1
    with pytest.raises(ConfigError) as err:
        build_config({}, ['parallel.ps_mode="asp"'])  # a PS mode on an all-reduce run is a mistake
    assert err.value.field == "parallel.ps_mode"


SHRINK = ["train.steps=4", "train.eval_every=4", "train.eval_batches=1", "train.sample_tokens=0", "model.d_model=32",
          "train.seq_len=16", 'data.source="synthetic"', "logging.tensorboard=false", "logging.peak_flops=1e9"]


def _train_ps(out: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tessel", "train", str(ROOT / "recipes/ps_demo.toml")]
    for o in SHRINK + [f'logging.out_dir="{out}"', *extra]:
        cmd += ["--set", o]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _allreduce_reference(out: Path, *extra: str) -> dict:
    """The all-reduce layout's arithmetic on one rank: dp = 2 becomes 2 accumulation chunks.

    Chunk k of the global batch is exactly dp rank k's shard, and the mean of the chunks'
    mean losses is all-reduce DP's average (tests/parallel/data/test_data_parallel.py checks DP against
    this single-process run); one process instead of a second torchrun keeps the test short.
    """
    from tessel.config import load_config
    from tests.helpers import train_and_collect
    cfg = load_config(ROOT / "recipes/ps_demo.toml", SHRINK + ['parallel.dp_arch="allreduce"', "parallel.dp=1",
                                                              "train.grad_accum=2", f'logging.out_dir="{out}"',
                                                              *extra])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return train_and_collect(cfg, weights=False)
    finally:
        torch.set_num_threads(threads)


def test_tessel_train_ps_bsp_matches_allreduce(tmp_path):
    proc = _train_ps(tmp_path / "ps")  # 2 workers + 1 server, through torchrun
    ref = _allreduce_reference(tmp_path / "ref")  # meanwhile, here
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out[-4000:]
    ps = metrics_rows(tmp_path / "ps")
    assert len(ps) == len(ref["losses"]) == 4
    assert all(r["staleness"] == 0 for r in ps)  # BSP: nobody is ever ahead
    # the same arithmetic but for the order of the gradient sum (the server's worker order vs
    # the chunks' accumulation) and the clipping norm's (float64 over the shard vs float32 per
    # tensor): float32 rounding, which AdamW's normalisation can lift to ~1e-6 relative in 4 steps
    # (the 40-step recipe against a real all-reduce run differed by at most 5e-7)
    assert_close([r["loss"] for r in ps], ref["losses"], rtol=1e-5, atol=1e-6)
    assert_close(ps[-1]["val_loss"], ref["val_loss"], rtol=1e-5, atol=1e-6)
    assert ps[-1]["loss"] < ps[0]["loss"]


def test_ps_checkpoints_resume_ps_and_allreduce_runs_both_ways(tmp_path):
    from tessel.train.checkpoint.manager import verify
    six = ["train.steps=6", "checkpoint.every=2"]
    # 2 workers + 2 servers: parameters are cut across servers, and worker 0 joins the pieces
    # (and writes them on a background thread: async_save)
    first = _train_ps(tmp_path / "full", "parallel.ps_servers=2", *six, "checkpoint.async_save=true")
    out, _ = first.communicate(timeout=240)
    assert first.returncode == 0, out[-4000:]
    full = [r["loss"] for r in metrics_rows(tmp_path / "full")]
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    manifest = verify(ckpt)  # whole and checksummed
    assert manifest["step"] == 2 and manifest["ps_updates"] == 2 and manifest["sampler"]["step"] == 2

    # the same PS layout resumed at step 2, and the all-reduce layout (one process) from the same files
    again = _train_ps(tmp_path / "again", "parallel.ps_servers=2", *six, f'checkpoint.resume="{ckpt}"')
    ref = _allreduce_reference(tmp_path / "ref", *six, f'checkpoint.resume="{ckpt}"')
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0, out[-4000:]
    resumed = metrics_rows(tmp_path / "again")
    assert [r["step"] for r in resumed] == [2, 3, 4, 5]
    # the servers get back the same float32 weights, moments and update count, the workers the same
    # data position: the same arithmetic in the same order, so bit for bit the uninterrupted run
    assert_close([r["loss"] for r in resumed], full[2:], rtol=0, atol=0)
    # all-reduce DP from the PS checkpoint: the tolerance of the BSP-vs-all-reduce test above
    # (float32 rounding of the gradient sum's order and of the clipping norm)
    assert_close(ref["losses"], full[2:], rtol=1e-5, atol=1e-6)

    # and back: a PS run (one server now) from the all-reduce run's own step-4 checkpoint
    back = _train_ps(tmp_path / "back", *six, f'checkpoint.resume="{tmp_path / "ref" / "checkpoints" / "step_00000004"}"')
    out, _ = back.communicate(timeout=240)
    assert back.returncode == 0, out[-4000:]
    assert_close([r["loss"] for r in metrics_rows(tmp_path / "back")], full[4:], rtol=1e-5, atol=1e-6)


def _wait_for_rows(out: Path, proc: subprocess.Popen, rows: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        path = out / "metrics.jsonl"
        if path.exists() and len(path.read_text().splitlines()) >= rows:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {rows} steps within {timeout}s")


MANY = 120


def test_ps_run_stops_on_a_signal_after_a_preemption_checkpoint_and_resumes_exactly(tmp_path):
    """Workers run the trainer's loop: SIGTERM to `tessel train` stops a BSP run after the step the
    workers agree on, worker 0 checkpoints the servers, and --resume continues bit for bit."""
    # short steps: the signal, sent once 3 rows are written, lands mid-run (120 steps take ~6 s)
    many = [f"train.steps={MANY}", "train.eval_every=0", "checkpoint.every=1000"]
    ref = _train_ps(tmp_path / "ref", *many)
    out, _ = ref.communicate(timeout=240)
    assert ref.returncode == 0, out[-4000:]
    run = tmp_path / "run"
    proc = _train_ps(run, *many)
    _wait_for_rows(run, proc, 3)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out[-4000:]
    done = len(metrics_rows(run))
    assert 3 <= done < MANY
    assert (run / "checkpoints" / f"step_{done:08d}").is_dir(), out[-4000:]
    assert f"stopped by SIGTERM after step {done}" in out
    again = _train_ps(run, *many, 'checkpoint.resume="auto"')
    out, _ = again.communicate(timeout=240)
    assert again.returncode == 0, out[-4000:]
    got, want = ({r["step"]: r["loss"] for r in metrics_rows(d)} for d in (run, tmp_path / "ref"))
    assert sorted(got) == list(range(MANY))
    assert all(got[step] == want[step] for step in range(MANY))  # BSP: the same arithmetic in the same order
