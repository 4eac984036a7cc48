"""`tessel train` with parallel.dp_arch = "ps": config rules, and BSP training that matches all-reduce DP."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.testing import assert_close

from tessel.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]


def ps_config(*overrides: str):
    # a fresh dict each time: overrides write into the nested sections
    return build_config({"parallel": {"dp": 2, "dp_arch": "ps", "ps_servers": 1}}, list(overrides))


@pytest.mark.parametrize("override, field", [
    ("parallel.tp=2", "parallel.tp"),
    ("parallel.pp=2", "parallel.pp"),
    ("parallel.zero_stage=1", "parallel.zero_stage"),
    ("parallel.ps_staleness=2", "parallel.ps_staleness"),  # staleness without ssp
    ("checkpoint.every=5", "checkpoint.every"),
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


def _train(out: Path, *overrides: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tessel", "train", str(ROOT / "recipes/ps_demo.toml"),
           "--set", "train.steps=4", "--set", "train.eval_every=4", "--set", "train.eval_batches=1",
           "--set", "train.sample_tokens=0", "--set", "model.d_model=32", "--set", "train.seq_len=16",
           "--set", 'data.source="synthetic"', "--set", "logging.tensorboard=false",
           "--set", "logging.peak_flops=1e9", "--set", f'logging.out_dir="{out}"']
    for o in overrides:
        cmd += ["--set", o]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def test_tessel_train_ps_bsp_matches_allreduce(tmp_path):
    # both runs at once: 2 workers + 1 server, and 2 all-reduce ranks, from the same recipe
    runs = {"ps": _train(tmp_path / "ps"), "allreduce": _train(tmp_path / "ar", 'parallel.dp_arch="allreduce"')}
    rows = {}
    for name, proc in runs.items():
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, f"{name}:\n{out[-4000:]}"
        path = tmp_path / ("ps" if name == "ps" else "ar") / "metrics.jsonl"
        rows[name] = [json.loads(line) for line in path.read_text().splitlines()]
    ps, ar = rows["ps"], rows["allreduce"]
    assert len(ps) == len(ar) == 4
    assert all(r["staleness"] == 0 for r in ps)  # BSP: nobody is ever ahead
    # the same arithmetic but for the order of the gradient sum (gloo's ring vs the server's
    # worker order) and the clipping norm's (float64 over the shard vs float32 per tensor):
    # float32 rounding, which AdamW's normalisation can lift to ~1e-6 relative in 4 steps
    assert_close([r["loss"] for r in ps], [r["loss"] for r in ar], rtol=1e-5, atol=1e-6)
    assert_close([r["lr"] for r in ps], [r["lr"] for r in ar], rtol=0, atol=0)
    assert_close(ps[-1]["val_loss"], ar[-1]["val_loss"], rtol=1e-5, atol=1e-6)
    assert ps[-1]["loss"] < ps[0]["loss"]
