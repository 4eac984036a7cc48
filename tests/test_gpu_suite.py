"""benchmarks/gpu_suite.py --smoke: the GPU suite's whole path on the CPU at toy shapes (the GPU run is the
lead's, on a lent machine; this keeps it runnable)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tessel.planner.gemm import GemmTable

ROOT = Path(__file__).resolve().parents[1]
RUNS = ("tessel eager", "tessel compiled", "compiled plain loop", "torchtitan")


def test_smoke_prints_every_row_beside_the_planner_and_writes_its_tables(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/gpu_suite.py", "--smoke"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for model in ("gpt2-124m", "llama-1.3b"):
        for run in RUNS:
            row = [line for line in lines if line.startswith(f"{model:<11} {run:<20}")]
            assert len(row) == 1, (model, run, done.stdout)
            # a run either measured (ms/step, tokens/s, MFU, then the planner's step time and the ratio), or
            # says in one line why not: only torchtitan may be missing on a CPU (it trains only on a GPU)
            measured = re.match(r".{32}\s+([\d.]+)\s+(\d+)\s+([\d.]+)\s+-\s+([\d.e+-]+)\s+([\d.e+-]+)$", row[0])
            if run == "torchtitan":
                assert measured or "not run: " in row[0], row[0]
            else:
                assert measured, row[0]
                ms, tokens_s, _, planner_ms, _ = (float(x) for x in measured.groups())
                assert ms > 0 and planner_ms > 0 and tokens_s > 0
    gemm_rows = [line for line in lines if re.match(r"\s+\d+\s+\d+\s+\d+\s+1\s+[\d.]+\s+[\d.]+\s+[\d.]+$", line)]
    assert len(gemm_rows) >= 10  # every GEMM of a block and the head, forward and backward, of the two models
    # ratios last, then the planner's error
    tail = lines[-8:]
    assert sum(line.startswith("ratio ") for line in tail) == 6 and tail[-1].startswith("planner: median")
    result = json.loads((tmp_path / "gpu_suite.json").read_text())
    assert len(result["rows"]) == 8 and all("predicted_s" in r for r in result["rows"])
    # the matmul table is in the format the planner reads (tessel/planner/gemm_tables/<preset>.json)
    table = GemmTable.from_dict(json.loads((tmp_path / "gemm_h100.json").read_text()))
    assert len(table.points) == len(gemm_rows) and all(s > 0 for _, s in table.points)
    assert table.gpu == "cpu" and "--smoke" in table.command


def test_fp8_benchmark_smoke_trains_both_precisions_and_prints_the_ratios_last(tmp_path):
    """benchmarks/fp8.py --smoke: bf16 and emulated fp8 on the CPU, the loss gap, the planner's ratio, the
    measured ratio last."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "benchmarks/fp8.py", "--smoke", "--steps", "28"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1].startswith("ratio tokens/s fp8 / bf16: ") and float(lines[-1].split()[-1]) > 0
    gap = next(line for line in lines if line.startswith("loss gap"))
    assert abs(float(gap.split()[-1])) < 0.05  # 28 steps of a toy model: float8's rounding, not a divergence
    result = json.loads((tmp_path / "fp8.json").read_text())
    assert set(result["runs"]) == {"bf16", "fp8"} and not result["errors"]
    assert all(len(r["losses"]) == 28 for r in result["runs"].values())
