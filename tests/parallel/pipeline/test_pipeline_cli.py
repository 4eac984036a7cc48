"""`tessel train` with a pipeline recipe writes the Chrome trace and the Gantt chart of a step."""

import json
import os
import subprocess
import sys

from tests.helpers import ROOT, metrics_rows


def test_tessel_train_pp_writes_trace_gantt_and_bubble(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tessel", "train", str(ROOT / "recipes/pp_demo.toml"),
           "--set", "parallel.pp=2", "--set", "train.steps=3", "--set", "train.eval_every=3",
           "--set", "train.sample_tokens=4", "--set", "model.d_model=32", "--set", "train.global_batch=8",
           "--set", "train.seq_len=16", "--set", f'logging.out_dir="{out}"']
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    trace = json.loads((out / "pipeline_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    # 2 ranks x 8 micro-batches x 2 chunks x (forward, backward), plus the messages
    assert sum(e["cat"] in ("forward", "backward") for e in spans) == 2 * 8 * 2 * 2
    assert {e["pid"] for e in spans} == {0, 1}
    assert (out / "pipeline_gantt.png").read_bytes()[:4] == b"\x89PNG"
    rows = metrics_rows(out)
    assert len(rows) == 3 and all(0 < r["bubble"] < 1 for r in rows)
    assert "val_loss" in rows[-1]
