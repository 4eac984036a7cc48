"""End to end: `tessel train` on the tiny recipe, through torchrun, as a user runs it."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, metrics_rows


def run_train(out_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "tessel", "train", str(ROOT / "recipes" / "tiny.toml"),
            "--set", f'logging.out_dir="{out_dir}"']
    for o in overrides:
        args += ["--set", o]
    return subprocess.run(args, capture_output=True, text=True, timeout=240, cwd=ROOT)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_tiny_recipe_trains_and_writes_metrics(tmp_path, precision):
    proc = run_train(tmp_path, f'train.precision="{precision}"')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = metrics_rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(20))  # a row per step
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_mb"):
        assert all(key in r for r in rows), key
    first, last = rows[0]["loss"], rows[-1]["loss"]
    assert last < first - 0.3, (first, last)
    assert 0 < rows[-1]["mfu"] < 1
    assert any((tmp_path / "tensorboard").iterdir())
    assert (tmp_path / "curves.png").stat().st_size > 10_000
    assert "dp groups: [[0, 1]]" in proc.stdout  # the mesh is printed
    assert "run summary" in proc.stdout and "tokens/s" in proc.stdout
