"""Training curves from metrics.jsonl, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

from tessel.config import ConfigError, output_file

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first

PLOTTED = ("step", "loss", "tokens_per_s", "lr")  # what every row of metrics.jsonl must carry to be drawn


def check_plot_args(metrics: str | Path, out: str | Path) -> None:
    """`tessel plot`'s inputs, checked before anything is drawn."""
    check_metrics(metrics)
    output_file("--out", out)


def check_metrics(path: str | Path) -> None:
    """A metrics.jsonl as tessel train writes it: one JSON object per line, each with the plotted numbers."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("METRICS", f"no such file: {path}")
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError("METRICS", f"cannot read {path}: {err}") from None
    rows = [(n, line) for n, line in enumerate(lines, 1) if line.strip()]
    if not rows:
        raise ConfigError("METRICS", f"{path} has no rows (did the run log a step?)")
    for n, line in rows:
        _check_row(path, n, line)


def _check_row(path: Path, n: int, line: str) -> None:
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        raise ConfigError("METRICS", f"{path} line {n} is not JSON") from None
    if not isinstance(row, dict):
        raise ConfigError("METRICS", f"{path} line {n} is not a JSON object")
    for key in PLOTTED:
        if key not in row:
            raise ConfigError("METRICS", f"{path} line {n} has no '{key}'")
        if isinstance(row[key], bool) or not isinstance(row[key], (int, float)):
            raise ConfigError("METRICS", f"{path} line {n}: '{key}' is {row[key]!r}, not a number")


def read_metrics(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_metrics(metrics_path: str | Path, out_png: str | Path) -> Path:
    """Loss (train and validation), throughput and learning rate against step."""
    rows = read_metrics(metrics_path)
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    axes[0].plot(steps, [r["loss"] for r in rows], label="train", lw=1)
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    if val:
        axes[0].plot(*zip(*val), "o-", label="validation")
    axes[0].set(title="loss", xlabel="step")
    axes[0].legend()
    axes[1].plot(steps, [r["tokens_per_s"] for r in rows], lw=1)
    axes[1].set(title="tokens/s", xlabel="step")
    axes[2].plot(steps, [r["lr"] for r in rows], lw=1)
    axes[2].set(title="learning rate", xlabel="step")
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
