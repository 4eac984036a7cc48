"""How well does the planner predict the real trainer? 4 ranks on this machine.

For each layout: the planner's prediction (cluster "this", probed, and the
reference GPT profiled at this size on 4 concurrent ranks) against a real run
of `python -m tessel train` with the layout's --set overrides: median
step_time_s after the first steps, and rank 0's peak_mem_mb (process RSS on
CPU, which the planner models as the probed runtime baseline + parameters,
gradients, optimizer state and activations). Layouts that the trainer cannot
run yet are reported as such. The "peer" of this benchmark is the measurement:
the last line is the median ratio predicted/measured step time.

    PYTHONPATH=$PWD python benchmarks/planner_accuracy.py            # re-measures the calibration
    PYTHONPATH=$PWD python benchmarks/planner_accuracy.py --cached   # reuses the cached probe/profile
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tessel.config import build_config, to_toml
from tessel.planner.cost import CostModel
from tessel.planner.layout import layout_config, parse_layout
from tessel.planner.model_spec import from_config
from tessel.planner.probe import probe_this, profile_model

WORLD = 4
BASE = {
    "model": {"vocab_size": 256, "n_layer": 4, "n_head": 4, "d_model": 256, "max_seq_len": 64},
    "train": {"steps": 10, "global_batch": 16, "seq_len": 64, "warmup_steps": 2, "eval_every": 0,
              "sample_tokens": 0},
    "data": {"source": "synthetic"},
    "logging": {"progress": False, "tensorboard": False, "peak_flops": 1e9},
}
SKIP = 3  # first steps pay for allocation and thread-pool warm-up
# (global batch, layout): the natural set for 4 ranks; DP-only ones run on main today
CASES = [
    (16, "dp=4,mb=4"), (16, "dp=2,tp=2,mb=4"), (16, "tp=4,mb=4"), (16, "dp=2,tp=2,mb=4,sp=1"),
    (16, "dp=4,mb=2"), (16, "dp=4,mb=1"), (8, "dp=4,mb=2"), (32, "dp=4,mb=8"), (32, "dp=4,mb=2"),
    (16, "dp=4,mb=4,zero=1"), (16, "dp=4,mb=4,zero=3"), (16, "dp=4,mb=4,recompute=1"),
    (16, "pp=2,dp=2,mb=2"), (16, "pp=4,mb=1"), (16, "pp=4,mb=1,schedule=gpipe"), (16, "pp=2,tp=2,mb=2"),
    (16, "pp=2,dp=2,mb=1,v=2"),
]


def runnable(cfg) -> str | None:
    """None if the trainer on this branch can run cfg, else why not."""
    try:
        from tessel.parallelize import _not_yet
    except ImportError:
        return None
    try:
        _not_yet(cfg)
    except NotImplementedError as err:
        return str(err)
    return None


def run_trainer(cfg, workdir: Path, name: str) -> dict:
    out_dir = workdir / name.replace(",", "_").replace("=", "")
    recipe = out_dir.with_suffix(".toml")
    out_dir.mkdir(parents=True, exist_ok=True)
    recipe.write_text(to_toml(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd()}
    cmd = [sys.executable, "-m", "tessel", "train", str(recipe), "--set", f'logging.out_dir="{out_dir}"']
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    metrics = out_dir / "metrics.jsonl"
    if proc.returncode != 0 or not metrics.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["?"]
        return {"error": tail[0][:120]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steady = rows[SKIP:]
    return {"step_s": statistics.median(r["step_time_s"] for r in steady),
            "mem_mib": max(r["peak_mem_mb"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", action="store_true", help="reuse the cached probe and profile")
    ap.add_argument("--only", default="", help="run only cases whose layout contains this text")
    args = ap.parse_args()
    base = build_config(BASE)
    spec = from_config(base.model, base.train.seq_len, base.train.global_batch, "bench")
    t0 = time.time()
    cluster = probe_this(WORLD, refresh=not args.cached)
    sizes = sorted({parse_layout(text, gb).mb for gb, text in CASES})
    cal = profile_model(base.model, base.train.seq_len, WORLD, sizes, "fp32", refresh=not args.cached)
    print(f"calibration: {time.time() - t0:.0f}s; matmul {cluster.peak_flops['fp32'] / 1e9:.2f} GFLOP/s/rank, "
          f"gloo {cluster.intra.bandwidth / 1e6:.0f} MB/s, {cluster.intra.latency * 1e6:.0f} us, "
          f"overlap {cluster.overlap:.2f}, runtime baseline {cluster.baseline_memory / 2**20:.0f} MiB; "
          f"model fwd+bwd {', '.join(f'{t} tok {f / 1e9:.2f}' for t, f in cal.flops_points)} GFLOP/s", flush=True)
    cm = CostModel(spec, cluster, "fp32", cal, base.parallel.bucket_mb)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tessel-plan-acc-") as tmp:
        for gb, text in CASES:
            if args.only and args.only not in text:
                continue
            lay = parse_layout(text, gb)
            cfg = layout_config(base, lay)
            est = cm.estimate(lay)
            row = {"gb": gb, "layout": lay.describe(), "pred_s": est.step_s,
                   "pred_mib": est.stage_memory[0]["total"] / 2**20}
            why = runnable(cfg)
            if why:
                row["status"] = f"not runnable yet ({why})"
            else:
                if not args.cached:  # the machine's speed drifts with its load: re-profile just before the run
                    fresh = profile_model(base.model, base.train.seq_len, WORLD, sizes, "fp32", refresh=True)
                    row["pred_fresh_s"] = CostModel(spec, cluster, "fp32", fresh, base.parallel.bucket_mb) \
                        .estimate(lay).step_s
                row.update(run_trainer(cfg, Path(tmp), text))
            rows.append(row)
            print(_line(row), flush=True)
    report(rows)


def _line(r: dict) -> str:
    if "step_s" not in r:
        return f"| {r['gb']} | {r['layout']} | {r['pred_s']:.3f} | - | - | - | - | {r['pred_mib']:.0f} | - | - | " \
               f"{r.get('status') or r.get('error')} |"
    fresh = r.get("pred_fresh_s")
    es = 100 * (r["pred_s"] / r["step_s"] - 1)
    ef = f"{100 * (fresh / r['step_s'] - 1):+.1f}%" if fresh else "-"
    em = 100 * (r["pred_mib"] / r["mem_mib"] - 1)
    return (f"| {r['gb']} | {r['layout']} | {r['pred_s']:.3f} | {fresh or 0:.3f} | {r['step_s']:.3f} | {es:+.1f}% | "
            f"{ef} | {r['pred_mib']:.0f} | {r['mem_mib']:.0f} | {em:+.1f}% | measured |")


def report(rows: list[dict]) -> None:
    print("\n| global batch | layout | predicted step s (start calibration) | predicted step s (fresh calibration) | "
          "measured step s | error (start) | error (fresh) | predicted MiB (rank 0) | measured MiB (rank 0) | "
          "error | status |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_line(r))
    done = [r for r in rows if "step_s" in r]
    if not done:
        print("nothing ran")
        return
    err = lambda key: statistics.median(abs(r[key] / r["step_s"] - 1) for r in done if r.get(key))  # noqa: E731
    mem_err = statistics.median(abs(r["pred_mib"] / r["mem_mib"] - 1) for r in done)
    print(f"\nmeasured layouts: {len(done)}; not runnable yet: {len(rows) - len(done)}")
    fresh = f", with a calibration just before each run {100 * err('pred_fresh_s'):.1f}%" \
        if any(r.get("pred_fresh_s") for r in done) else ""
    print(f"median |step-time error|: {100 * err('pred_s'):.1f}% with the start calibration{fresh}")
    print(f"median |memory error|: {100 * mem_err:.1f}%")
    for gb in sorted({r["gb"] for r in done}):
        group = [r for r in done if r["gb"] == gb]
        if len(group) < 2:
            continue
        pick = min(group, key=lambda r: r["pred_s"])  # one calibration for the whole group: a fair ranking
        best = min(group, key=lambda r: r["step_s"])
        gap = 100 * (pick["step_s"] / best["step_s"] - 1)
        print(f"global batch {gb}: planner picks {pick['layout']}, measured best {best['layout']} "
              f"({'same' if pick is best else f'{gap:.1f}% slower than the best'})")
    ratio = statistics.median(r["pred_s"] / r["step_s"] for r in done)
    print(f"ratio predicted/measured step time (median, start calibration): {ratio:.3f}")


if __name__ == "__main__":
    main()
