"""Measured pipeline bubble vs theory, and saved-activation peaks, for GPipe, 1F1B and interleaved 1F1B.

    PYTHONPATH=. python benchmarks/pp_bubble.py --pp 2 --micro-batches 4 8 --steps 6

A balanced model: every stage holds the same number of blocks, the vocabulary
is small so the embedding and output head cost little next to a block. The
bubble of a step is 1 - (compute time summed over stages) / (p * step span),
measured by the runner from its own timestamps (tessel.parallel.pipeline.runner).
Theory: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved
with v virtual stages. Also printed: the bytes of activations saved for
backward at the peak of a step on the most loaded rank, and "sim": the bubble
the schedule would have with the step's measured forward/backward times per
rank and free messages (schedules.simulate), which separates stage imbalance
and B/F ratio (in sim) from message latency and OS scheduling (measured - sim).
The last line gives measured/theory per configuration.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist


def _bench(args) -> list[tuple]:
    from tessel.config import build_config
    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    from tessel.parallelize import parallelize
    p = dist.get_world_size()
    mesh = make_mesh({"pp": p})
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    y = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    rows = []
    for m in args.micro_batches:
        for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2)):
            raw = {"model": {"vocab_size": 256, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                             "max_seq_len": args.seq},
                   "parallel": {"pp": p, "schedule": name, "virtual_stages": v, "micro_batches": m},
                   "train": {"global_batch": args.batch, "seq_len": args.seq}, "data": {"source": "synthetic"}}
            cfg = build_config(raw)
            torch.manual_seed(0)
            runner = parallelize(GPT(cfg.model), mesh, cfg)
            bubbles, peaks, sims = [], [], []
            for step in range(args.warmup + args.steps):
                dist.barrier()  # every rank starts the step together, as after an optimizer step
                runner.forward_backward(x, y)
                for q in runner.parameters():
                    q.grad = None
                if step >= args.warmup:
                    bubbles.append(runner.extra_metrics()["bubble"])
                    peaks.append(runner.extra_metrics()["act_peak_mb"])
                    sims.append(_simulated(runner, name, p, m, v))
            rows.append((name, v, m, statistics.median(bubbles), statistics.median(sims), max(peaks)))
    return rows


def _simulated(runner, name: str, p: int, m: int, v: int) -> float:
    """The bubble this schedule would have with this step's measured compute times and free messages."""
    from tessel.parallel.pipeline.schedules import bubble_fraction, build_schedule, simulate
    per_rank: list = [None] * p
    dist.all_gather_object(per_rank, runner.events)
    times = {}
    for r, events in enumerate(per_rank):
        for kind, mb, chunk, start, end in events:
            if kind in ("F", "B"):
                times.setdefault((r, kind, chunk), []).append(end - start)
    mean = {k: statistics.mean(t) for k, t in times.items()}
    timeline = simulate(build_schedule(name, p, m, v), v, strict=False,
                        cost=lambda r, a: mean[(r, a.kind, a.chunk)])
    return bubble_fraction(timeline)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    args = ap.parse_args()
    from tessel.spawn import spawn
    rows = spawn(_bench, args.pp, args, timeout=3600)[0]
    p = args.pp
    print(f"pp={p} batch={args.batch}x{args.seq} d_model={args.d_model} layers={args.layers}; "
          f"median over {args.steps} steps (gloo, CPU, one thread per rank)")
    print(f"{'schedule':<15} {'m':>3} {'measured':>9} {'theory':>7} {'meas/theory':>12} {'sim(measured F/B)':>18} "
          f"{'act peak MiB':>13}")
    ratios = []
    for name, v, m, bubble, sim, peak in rows:
        theory = (p - 1) / (v * m + p - 1)
        label = name if v == 1 else f"{name} v={v}"
        print(f"{label:<15} {m:>3} {bubble:9.3f} {theory:7.3f} {bubble / theory:12.2f} {sim:18.3f} {peak:13.2f}")
        ratios.append(f"{label} m={m} {bubble / theory:.2f}")
    print("bubble measured/theory: " + "  ".join(ratios))


if __name__ == "__main__":
    main()
