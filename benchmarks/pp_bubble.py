"""Measured pipeline bubble vs theory, and saved-activation peaks, for GPipe, 1F1B, interleaved 1F1B and the
zero-bubble schedules ZB-H1, ZB-H2 and ZBV.

    PYTHONPATH=. python benchmarks/pp_bubble.py --pp 2 --micro-batches 4 8 --steps 6

A balanced model: every stage holds the same number of blocks, and the
vocabulary is small (64) so the embedding (first stage) and the output head
and loss (last stage) cost about 1% of a stage's blocks: with integer blocks per
stage that extra work cannot be balanced away, and at m=8 a stage 5% heavier
than the other already raises the bubble by 15%. Each action computes a lot
(d_model 256, 4 sequences of 128 tokens per micro-batch) next to what a message
costs on 2 shared cores (a few ms: the sender is often preempted when it wakes
the receiver), a cost the formula counts as zero.

Read the numbers with this machine in mind: its 2 vCPUs do not act as two
independent devices. A rank computing alone (pipeline fill and drain) runs
about twice as fast as when both ranks compute at once (measured: the first
forward of a GPipe step 0.42 s, the next three, overlapped, 0.86-1.0 s), so
the fill and drain the formula charges shrink, and the measured bubble can
fall below theory. With other jobs on the machine it varies by +-30% from run
to run: run it several times and quote medians.

The bubble of a step is 1 - (forward/backward time summed over stages) /
(p * step span), measured by the runner from its own timestamps
(tessel.parallel.pipeline.runner). Theory: (p-1)/(m+p-1) for GPipe and 1F1B,
(p-1)/(v*m+p-1) for interleaved with v virtual stages, and with the backward
split into B and W of one forward's time each (Qi et al. 2023): (p-1)/(3m+p-1)
for ZB-H1 and ZB-H2 (a step ends in the optimizer's synchronous update, so the
last rank's wait for its first input, (p-1) F, stays) and (p-1)/(6m+p-1) for
ZBV (half-stage chunks halve that wait). Configurations take
turns step by step, so a change of load on the machine hits all alike. Also
printed: the mean forward/backward ms of each rank (the balance), the bytes
of activations saved for backward at the peak of a step on the most loaded
rank, and "sim": the bubble the schedule would have with the step's measured
compute times and free messages (schedules.simulate), which separates stage
imbalance (in sim) from message cost and OS scheduling (measured - sim).
The last line gives measured/theory per configuration.

`--device-ms F` runs the same schedules on emulated devices
(tessel.models.emulated): every block's forward waits F ms and its backward
2F ms in time.sleep (F for the input's gradient, F for the weights', which a
split backward runs apart), after its (tiny) real compute, the way a host waits
on an accelerator's kernels. Sleeping ranks
do not compete for the 2 vCPUs, so the stages behave as independent devices
of equal speed, and the measured bubble shows what the runner itself adds to
the schedule (messages, Python, waits) on top of the formula:

    PYTHONPATH=. python benchmarks/pp_bubble.py --device-ms 10 --d-model 32 --seq 16 --batch 16

`--gantt DIR` writes each configuration's last step as a Gantt chart (the
runner's own, tessel.observe.timeline) to DIR/pp{p}_{schedule}_m{m}.png.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1, "zb-h2": 1, "zbv": 2,  # name: chunks per rank
             "2bw": 1, "pipedream": 1}
ASYNC = ("2bw", "pipedream")


def theory(name: str, p: int, m: int, v: int) -> float:
    """The bubble on equal stages with free messages (F, and B = W = F where the backward is split)."""
    if name in ("zb-h1", "zb-h2"):
        return (p - 1) / (3 * m + p - 1)
    if name == "zbv":
        return (p - 1) / (6 * m + p - 1)
    if name in ASYNC:  # no flush: a steady step is busy throughout (tessel.parallel.pipeline.async_schedules)
        return 0.0
    return (p - 1) / ((v if name == "interleaved" else 1) * m + p - 1)


def _runner(p: int, name: str, v: int, m: int, args):
    from tessel.config import build_config
    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    from tessel.apply import parallelize
    raw = {"model": {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"pp": p, "schedule": name, "virtual_stages": v, "micro_batches": m,
                        "allow_async": name in ASYNC},
           "train": {"global_batch": args.batch, "seq_len": args.seq, "grad_clip": 0.0 if name == "pipedream" else 1.0},
           "data": {"source": "synthetic"}}
    cfg = build_config(raw)
    torch.manual_seed(0)
    model = GPT(cfg.model)
    if args.device_ms:
        from tessel.models.emulated import emulate_devices
        emulate_devices(model, args.device_ms / 1e3)
    runner = parallelize(model, make_mesh({"pp": p}), cfg)
    runner.timeline = False
    return runner


def _bench(args) -> list[tuple]:
    p = dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    configs = [(name, SCHEDULES[name], m) for m in args.micro_batches for name in args.schedules]
    runners = [_runner(p, name, v, m, args) for name, v, m in configs]
    samples: list[dict] = [{"bubble": [], "sim": [], "peak": [], "fb": []} for _ in configs]
    for step in range(args.warmup + args.steps):
        for (name, v, m), runner, s in zip(configs, runners, samples):
            dist.barrier()  # every rank starts the step together, as after an optimizer step
            runner.forward_backward(x, y)
            for q in runner.parameters():
                q.grad = None
            metrics = runner.extra_metrics()  # collective
            if step >= args.warmup:
                sim, fb = _simulated(runner, name, p, m, v)
                s["bubble"].append(metrics["bubble"])
                s["peak"].append(metrics["act_peak_mb"])
                s["sim"].append(sim)
                s["fb"].append(fb)
    if args.gantt:
        _gantts(runners, configs, p, args.gantt)
    return [(name, v, m, statistics.median(s["bubble"]), statistics.median(s["sim"]), max(s["peak"]),
             [tuple(statistics.median(f[r][k] for f in s["fb"]) for k in range(3)) for r in range(p)])
            for (name, v, m), s in zip(configs, samples)]


def _gantts(runners, configs, p: int, folder: str) -> None:
    """Each configuration's last step drawn by the runner (collective), renamed after it on rank 0."""
    import shutil
    import tempfile
    from pathlib import Path
    for runner, (name, _, m) in zip(runners, configs):
        with tempfile.TemporaryDirectory() as tmp:
            runner.timeline = True
            files = runner.write_timeline(tmp)
            if files:
                Path(folder).mkdir(parents=True, exist_ok=True)
                shutil.copy(files["pipeline gantt"], Path(folder) / f"pp{p}_{name}_m{m}.png")


def _simulated(runner, name: str, p: int, m: int, v: int) -> tuple[float, list[tuple[float, float]]]:
    """The bubble with this step's measured compute times and free messages; each rank's mean F, B, W ms."""
    from tessel.parallel.pipeline.async_schedules import build_async
    from tessel.parallel.pipeline.schedules import COMPUTE, bubble_fraction, build_schedule, is_vshape, simulate
    per_rank: list = [None] * p
    dist.all_gather_object(per_rank, runner.recorder.events)
    times: dict = {}
    for r, events in enumerate(per_rank):
        for kind, mb, chunk, start, end in events:
            if kind in COMPUTE:
                times.setdefault((r, kind, chunk), []).append(end - start)
    mean = {k: statistics.mean(t) for k, t in times.items()}
    if name in ASYNC:  # a steady step, continuing the last
        plan = build_async(p, m)
        lists, carried = plan.steps[-1], [set(c) for c in plan.carried[-1]]
    else:
        lists, carried = build_schedule(name, p, m, v), None
    timeline = simulate(lists, v, strict=False, vshape=is_vshape(name), carried=carried,
                        cost=lambda r, a: mean[(r, a.kind, a.chunk)])
    # a rank's F (B, W) time for one micro-batch over all of its chunks
    fb = [tuple(1e3 * sum(mean.get((r, k, c), 0.0) for c in range(v)) for k in COMPUTE) for r in range(p)]
    return bubble_fraction(timeline), fb


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=64)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    ap.add_argument("--gantt", default="", help="a folder for each configuration's Gantt chart")
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="emulated devices: each block's forward sleeps this many ms, its backward twice")
    args = ap.parse_args()
    from tessel.spawn import spawn
    rows = spawn(_bench, args.pp, args, timeout=3600)[0]
    p = args.pp
    print(f"pp={p} batch={args.batch}x{args.seq} d_model={args.d_model} layers={args.layers} vocab={args.vocab}; "
          f"median over {args.steps} steps (gloo, CPU, one thread per rank"
          + (f"; emulated devices, {args.device_ms:g} ms per block forward)" if args.device_ms else ")"))
    print(f"{'schedule':<15} {'m':>3} {'measured':>9} {'theory':>7} {'meas/theory':>12} {'sim':>6} "
          f"{'act peak MiB':>13}  F/B/W ms per micro-batch, by rank")
    ratios = []
    for name, v, m, bubble, sim, peak, fb in rows:
        ideal = theory(name, p, m, v)
        label = name if v == 1 else f"{name} v={v}"
        balance = "  ".join(f"{f:.0f}/{b:.0f}" + (f"/{w:.0f}" if w else "") for f, b, w in fb)
        ratio = f"{bubble / ideal:12.2f}" if ideal else f"{'-':>12}"
        print(f"{label:<15} {m:>3} {bubble:9.3f} {ideal:7.3f} {ratio} {sim:6.3f} {peak:13.2f}  {balance}")
        ratios.append(f"{label} m={m} " + (f"{bubble / ideal:.2f}" if ideal else f"{bubble:.3f} (theory 0)"))
    print("bubble measured/theory: " + "  ".join(ratios))


if __name__ == "__main__":
    main()
