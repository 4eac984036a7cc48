"""tessel's pipeline schedules vs torch.distributed.pipelining on the same model, stages and micro-batches.

    PYTHONPATH=. python benchmarks/pp_vs_torch.py --pp 2 --micro-batches 8 --steps 20
    PYTHONPATH=. python benchmarks/pp_vs_torch.py --schedules zbv zb-h1

For each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages, and the
zero-bubble ones: tessel's ZBV against torch's ScheduleZBVZeroBubble, both with
2 stages a rank in a V, and tessel's ZB-H1 against ScheduleInterleavedZeroBubble
given one stage a rank, torch's zero-bubble schedule for that placement) both
libraries run the same chunks of one GPT (built from one seed, cut by tessel's
partitioner), the same batch and micro-batch count, on gloo with one thread
per rank. Steps alternate between the two, and which goes first alternates
too, so load changes on the machine hit both alike. Both sides compute the
same loss (mean cross-entropy of each micro-batch, averaged over the
micro-batches: torch scales the summed gradients by 1/m, tessel the loss) and
both set gradients to None after each step; tessel also hands the loss to
every pipeline rank, torch keeps it on the last stage. A step's time is the slowest rank's, after a barrier. Prints
medians per schedule, the ratio of medians and the median of per-step paired
ratios, and, last, the paired ratios tessel/torch (lower is better for tessel).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist


def _config(pp: int, schedule: str, m: int, args):
    from tessel.config import build_config
    v = 2 if schedule in ("interleaved", "zbv") else 1
    raw = {"model": {"vocab_size": 256, "n_layer": args.layers, "n_head": 4, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"pp": pp, "schedule": schedule, "virtual_stages": v, "micro_batches": m},
           "train": {"global_batch": args.batch, "seq_len": args.seq, "sample_tokens": 0, "eval_every": 0},
           "data": {"source": "synthetic"}}
    return build_config(raw)


def _torch_schedule(model, cfg, mesh, rank, p):
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
                                              ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble)

    from tessel.models.gpt import cross_entropy
    from tessel.parallel.pipeline.partition import split_model
    from tessel.parallel.pipeline.apply import choose_layout
    from tessel.parallel.pipeline.schedules import is_vshape, stage_of
    name = cfg.parallel.schedule
    layout = choose_layout(model, mesh, cfg.parallel, cfg.train, cfg.model.n_layer)
    chunks = split_model(model, layout, rank, p, vshape=is_vshape(name))
    n = len(layout)
    # the same stages in the same places: rank r holds stages r, r+p (a loop) or r, 2p-1-r (ZBV's V)
    stages = [PipelineStage(c, stage_of(p, rank, i, is_vshape(name)), n, mesh.device) for i, c in enumerate(chunks)]
    m = cfg.parallel.micro_batches
    if name in ("interleaved", "zbv", "zb-h1"):
        cls = {"interleaved": ScheduleInterleaved1F1B, "zbv": ScheduleZBVZeroBubble,
               "zb-h1": ScheduleInterleavedZeroBubble}[name]
        return cls(stages, m, loss_fn=cross_entropy), chunks
    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stages[0], m, loss_fn=cross_entropy), chunks


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
    return t.item()


def _bench(args) -> dict:
    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    from tessel.apply import parallelize
    rank, p = dist.get_rank(), dist.get_world_size()
    mesh = make_mesh({"pp": p})
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    y = torch.randint(0, 256, (args.batch, args.seq), generator=g)
    out = {}
    for name in args.schedules:
        cfg = _config(p, name, args.micro_batches, args)
        torch.manual_seed(0)
        ours = parallelize(GPT(cfg.model), mesh, cfg)
        ours.timeline = False
        torch.manual_seed(0)
        theirs, their_chunks = _torch_schedule(GPT(cfg.model), cfg, mesh, rank, p)

        def step_ours():
            ours.forward_backward(x, y)
            for q in ours.parameters():
                q.grad = None

        last = 0 if name == "zbv" else p - 1  # the rank holding the last stage (the loss)

        def step_theirs():
            if rank == 0 and rank == last:
                theirs.step(x, target=y, losses=[])
            elif rank == 0:
                theirs.step(x)
            elif rank == last:
                theirs.step(target=y, losses=[])
            else:
                theirs.step()
            for c in their_chunks:
                c.zero_grad(set_to_none=True)

        t_ours, t_theirs = [], []
        for i in range(args.warmup + args.steps):
            # alternate who goes first (ABBA), so neither side always runs on the other's leftovers
            if i % 2 == 0:
                a, b = _timed(step_ours), _timed(step_theirs)
            else:
                b, a = _timed(step_theirs), _timed(step_ours)
            if i >= args.warmup:
                t_ours.append(a)
                t_theirs.append(b)
        paired = statistics.median(a / b for a, b in zip(t_ours, t_theirs))
        out[name] = (statistics.median(t_ours), statistics.median(t_theirs), paired)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--schedules", nargs="+", default=["gpipe", "1f1b", "interleaved"],
                    choices=["gpipe", "1f1b", "interleaved", "zb-h1", "zbv"])
    args = ap.parse_args()
    from tessel.spawn import spawn
    res = spawn(_bench, args.pp, args, timeout=1800)[0]
    print(f"pp={args.pp} micro-batches={args.micro_batches} batch={args.batch}x{args.seq} "
          f"d_model={args.d_model} layers={args.layers}; median step over {args.steps} steps (gloo, CPU)")
    print(f"{'schedule':<12} {'tessel ms':>10} {'torch ms':>10} {'ratio of medians':>17} {'median paired ratio':>20}")
    for name, (ours, theirs, paired) in res.items():
        print(f"{name:<12} {ours * 1e3:10.1f} {theirs * 1e3:10.1f} {ours / theirs:17.3f} {paired:20.3f}")
    # paired: each tessel step against the torch step right after it, so load swings cancel
    print("ratio tessel/torch (median paired): " + "  ".join(f"{n} {p:.3f}" for n, (_, _, p) in res.items()))


if __name__ == "__main__":
    main()
