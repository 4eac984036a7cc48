"""The demo recipe's loss curve in fp8 against bf16 on the CPU (float8 emulated): issue 33's convergence check.

    python benchmarks/fp8_curve.py                      # trains recipes/hybrid_demo.toml 3 times, 300 steps
    python benchmarks/fp8_curve.py --out /tmp/curves    # where the runs go (an existing run is read, not redone)

recipes/hybrid_demo.toml (dp2 x tp2 x pp2, 8 CPU ranks, the stdlib corpus) for 300 steps in bf16, in fp8 with
tensorwise scaling and in fp8 with rowwise scaling, from the same seed, weights and batches. Writes
docs/fp8_demo_loss.png (training and validation losses) and prints each fp8 run's gap to bf16 at the end: the
last step's training loss, the mean of the last 20, and the last validation loss, as fp8 / bf16 - 1. Gaps last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {"bf16": ['train.precision="bf16"'], "fp8 tensorwise": ['train.precision="fp8"'],
        "fp8 rowwise": ['train.precision="fp8"', 'train.fp8_recipe="rowwise"']}


def train(name: str, out: Path, steps: int) -> list[dict]:
    folder = out / name.replace(" ", "_")
    if not (folder / "metrics.jsonl").exists():
        sets = [*RUNS[name], f"train.steps={steps}", f'logging.out_dir="{folder}"', "train.sample_tokens=0",
                "logging.progress=false"]
        args = [x for s in sets for x in ("--set", s)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([sys.executable, "-m", "tessel", "train", "recipes/hybrid_demo.toml", *args], cwd=ROOT,
                       env=env, check=True, stdout=subprocess.DEVNULL)
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def plot(rows: dict[str, list[dict]], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, rs in rows.items():
        train_rows = [r for r in rs if "loss" in r]
        line, = ax.plot([r["step"] for r in train_rows], [r["loss"] for r in train_rows], lw=0.8, label=name)
        val = [r for r in rs if r.get("val_loss") is not None]
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o--", color=line.get_color(), ms=4)
    ax.set(xlabel="step", ylabel="loss (lines: training; dots: validation)", ylim=(1.5, 3.5),
           title="recipes/hybrid_demo.toml (dp2 x tp2 x pp2, CPU, float8 emulated)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/fp8_curve", help="where the three runs go")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    rows = {name: train(name, Path(args.out), args.steps) for name in RUNS}
    plot(rows, ROOT / "docs" / "fp8_demo_loss.png")
    base = rows["bf16"]

    def ends(rs: list[dict]) -> tuple[float, float, float]:
        losses = [r["loss"] for r in rs if "loss" in r]
        val = [r["val_loss"] for r in rs if r.get("val_loss") is not None]
        return losses[-1], statistics.mean(losses[-20:]), val[-1]
    for name in ("fp8 tensorwise", "fp8 rowwise"):
        gaps = [a / b - 1 for a, b in zip(ends(rows[name]), ends(base))]
        print(f"{name} / bf16 - 1 at step {args.steps}: last loss {gaps[0]:+.4f}, mean of the last 20 "
              f"{gaps[1]:+.4f}, validation {gaps[2]:+.4f}")


if __name__ == "__main__":
    main()
