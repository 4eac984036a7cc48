"""Activation memory per rank under context parallelism at a long sequence: measured, and as planned.

The tiny model of the tests (tests/helpers.TINY: 2 layers, d_model 32, 4 heads, 256 ids) on one sequence of
8192 tokens, fp32: one process (cp1), then ring cp2 and cp4 and Ulysses cp2 and cp4, each rank measuring the
peak bytes one step's forward and backward allocate above what it held before (the profiler's allocation
record on CPU: tessel.testing.activations.step_peak), next to the cost model's activations term for the same
layout (planned_peak). Prints one row per layout (the largest rank's peak), then the ratio of the cp4 ring's
per-rank peak to one process's, last.

    PYTHONPATH=$PWD python benchmarks/cp_memory.py [--seq 8192]
"""

from __future__ import annotations

import argparse

from tessel.testing.activations import planned_peak, step_peak
from tessel.config import build_config
from tessel.spawn import spawn
from tests.helpers import TINY

LAYOUTS = {"cp1": (1, "ring"), "ring cp2": (2, "ring"), "ring cp4": (4, "ring"),
           "ulysses cp2": (2, "ulysses"), "ulysses cp4": (4, "ulysses")}


def _config(seq: int, cp: int, mode: str):
    raw = {k: dict(v) for k, v in TINY.items()}
    raw["model"]["max_seq_len"] = seq
    raw["train"].update(seq_len=seq, global_batch=1)
    raw["parallel"] = {"cp": cp, "cp_mode": mode}
    return build_config(raw)


def _measure(seq: int, cp: int, mode: str) -> int:
    return step_peak(_config(seq, cp, mode))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=8192)
    args = ap.parse_args()
    mib = 2**20
    print(f"tiny model, one sequence of {args.seq} tokens, fp32: peak bytes a step allocates per rank")
    print(f"{'layout':<12} {'measured MiB':>13} {'x cp1':>7} {'planned MiB':>12} {'planned/measured':>17}")
    whole = None
    peaks = {}
    for name, (cp, mode) in LAYOUTS.items():
        peak = max(spawn(_measure, cp, args.seq, cp, mode, timeout=1800) if cp > 1 else [_measure(args.seq, 1, mode)])
        whole = whole or peak
        peaks[name] = peak
        planned = planned_peak(_config(args.seq, cp, mode))
        print(f"{name:<12} {peak / mib:13.2f} {peak / whole:7.3f} {planned / mib:12.2f} {planned / peak:17.3f}",
              flush=True)
    print(f"ring cp4 / cp1 per-rank peak: {peaks['ring cp4'] / whole:.3f} (1/cp = 0.250)")


if __name__ == "__main__":
    main()
