"""Training curves from metrics.jsonl, as a PNG (matplotlib, no display needed)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402 - the backend must be chosen first


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
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
