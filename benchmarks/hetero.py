"""Heterogeneous devices (speeds 1 and 2): the split in proportion to speed vs the even split, measured.

    PYTHONPATH=. python benchmarks/hetero.py [--steps 8] [--flops 5e7] [--account]

Two ranks on emulated accelerators (tessel.models.emulated: every block takes
its matmul FLOPs / the device's FLOP/s, its own CPU math inside that time and
the rest in time.sleep, so the 2 ranks of this 2-core machine behave as
independent devices), rank 1's twice as fast as
rank 0's (runtime.device_speeds = [1, 2]). Two layouts, each run evenly and
in proportion to speed, steps of the four configurations alternating so that
a change in the machine's load hits all alike (Trainer.train_step: data,
forward and backward, clipping, AdamW):

- dp2: 6 micro-batches a step, [3, 3] or [2, 4] (parallel.dp_split = "speed",
  the loss weighted by each rank's share: tessel.parallel.data.uneven);
- pp2 (1F1B, 8 micro-batches of 1 sequence): 6 blocks, [3, 3] or [2, 4] (parallel.pp_balance
  = "speed").

The ideal is 1.5x for dp2: evenly, the slow rank's 3 units bound the step
while the fast one idles half of it; in proportion, each runs 2 units. For
pp2, 1F1B's fill and drain make it 1.36x at m = 8 (evenly the slow stage's
8 x 9 units and 1.5 of fill, 73.5; in proportion (m+p-1) x 6 = 54). The
pipeline also prints the planner's prediction (tessel.planner.hetero.gain,
the flush replayed by the event simulator). Prints the median step times and
the speedups, the pipeline's last. The equality of the losses is tested in
tests/parallel/data/test_uneven.py.

--account also prints where each rank's step goes (the emulated devices'
ledgers, tessel.models.emulated.Ledger): the blocks' device time, the CPU of
their math (inside that time), the CPU outside the blocks (embedding, head,
loss, optimizer, runtime), the oversleep the next blocks did not take back,
and the rest (waiting for the other rank, messages).

Measured on this shared 2-core machine at load 1.3-4.9, ten runs: dp2 1.45x
(median), pp2 1.31x (1.28-1.33); the simulator predicts 1.36x for pp2, 1F1B's
ideal at m = 8 (73.5 units of the slow stage evenly against 54). What the
pipeline misses of it is, on its fast last stage, the CPU work outside the
emulated blocks (head, loss, runtime: 25 ms of a 502 ms step, at the CPU's
speed on either device) and 14 ms of messages and waits beyond 1F1B's fill
and drain. Before the emulator took a block's own math inside its device
time (A/B at load 2.5: 1.25-1.27x before, 1.31-1.32x after), that math was
added to every block on either device alike.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tessel.apply import parallelize  # noqa: E402
from tessel.calibrate.speeds import resolve  # noqa: E402
from tessel.config import Config, build_config  # noqa: E402
from tessel.elastic.adaptive import emulated_flops  # noqa: E402
from tessel.mesh import make_mesh  # noqa: E402
from tessel.models.build import build_model  # noqa: E402
from tessel.models.emulated import EmulatedDevice, Ledger, emulate_device  # noqa: E402
from tessel.spawn import spawn  # noqa: E402
from tessel.train.trainer import Trainer  # noqa: E402

LAYOUTS = {"dp2": ({"dp": 2}, {"dp_split": "speed"}, {"grad_accum": 3, "global_batch": 12}),
           "pp2": ({"pp": 2, "micro_batches": 8}, {"pp_balance": "speed"}, {"global_batch": 8})}


def recipe(args, name: str, by_speed: bool) -> Config:
    parallel, speed, train = LAYOUTS[name]
    return build_config({
        "model": {"vocab_size": 256, "n_layer": 6 if name == "pp2" else 2, "n_head": 4, "d_model": 32,
                  "max_seq_len": 16},
        "parallel": {**parallel, **(speed if by_speed else {})},
        "train": {"steps": 1000, "seq_len": 16, "warmup_steps": 0, "eval_every": 0, "sample_tokens": 0, **train},
        "data": {"source": "synthetic"},
        "runtime": {"emulate_flops": args.flops, "device_speeds": [1.0, 2.0]},
        "logging": {"out_dir": args.out, "progress": False, "tensorboard": False, "peak_flops": 1e12}})


def _trainer(cfg: Config) -> tuple[Trainer, EmulatedDevice]:
    """What `tessel train` builds on each rank (tessel.elastic.rank.train_rank), the blocks on emulated devices."""
    rank, world = dist.get_rank(), dist.get_world_size()
    flops = emulated_flops(cfg, rank, world)
    cfg = resolve(cfg, torch.device("cpu"), flops)
    p = cfg.parallel
    mesh = make_mesh(p.axis_sizes, order=p.rank_order)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    device = emulate_device(model, flops)
    return Trainer(cfg, mesh, parallelize(model, mesh, cfg), rank), device


def _bench(args) -> dict:
    runs = {(name, by_speed): _trainer(recipe(args, name, by_speed)) for name in LAYOUTS for by_speed in (False, True)}
    times: dict = {key: [] for key in runs}
    books: dict = {key: [] for key in runs}  # per step: (wall, device, math, CPU outside the blocks, oversleep)
    for step in range(args.warmup + args.steps):
        for key, (trainer, device) in runs.items():
            dist.barrier()
            before, cpu0 = replace(device.ledger), time.thread_time()
            t0 = time.perf_counter()
            trainer.train_step(step)
            if step >= args.warmup:
                times[key].append(time.perf_counter() - t0)
                books[key].append(_account(times[key][-1], time.thread_time() - cpu0, before, device.ledger))
    split = {key: t.cfg.parallel.dp_shares or t.cfg.parallel.pp_layout for key, (t, _) in runs.items()}
    return {key: (statistics.median(t), split[key], [statistics.median(col) for col in zip(*books[key])])
            for key, t in times.items()}


def _account(wall: float, cpu: float, before: Ledger, after: Ledger) -> tuple[float, ...]:
    """One step of one rank: wall, the blocks' device time, their math's CPU, the CPU outside them, and the
    oversleep the next kernels did not take back."""
    math = after.math_s - before.math_s
    late = (after.oversleep_s - before.oversleep_s) - (after.credit_s - before.credit_s)
    return wall, after.device_s - before.device_s, math, cpu - math, late


def predicted_pipeline(args) -> float:
    """The planner's speedup of the speed-proportional cut of pp2 (tessel.planner.hetero), on a cost model of
    the emulated device (its FLOP/s the cluster's peak; the real compute of these tiny blocks ignored)."""
    from tessel.planner.cluster import Cluster, Link
    from tessel.planner.cost import CostModel
    from tessel.planner.hetero import gain
    from tessel.planner.layout import config_layout
    from tessel.planner.model_spec import from_config
    cfg = recipe(args, "pp2", False)
    link = Link(1e10, 1e-4)
    cluster = Cluster("emulated", 1, 2, {"fp32": args.flops, "bf16": args.flops}, 2**33, link, link, 1e10)
    est = CostModel(from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch), cluster, "fp32").estimate(
        config_layout(cfg))
    return gain(est, [1.0, 2.0], cfg.model.n_layer).speedup


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flops", type=float, default=5e7, help="FLOP/s of the slower emulated device")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--account", action="store_true", help="also print where each rank's step time goes")
    args = ap.parse_args()
    import tempfile
    args.out = tempfile.mkdtemp(prefix="tessel-hetero-bench-")
    ranks = spawn(_bench, 2, args, timeout=1800)
    got = ranks[0]
    print(f"2 ranks on emulated devices of {args.flops:.3g} and {2 * args.flops:.3g} FLOP/s; median of "
          f"{args.steps} steps")
    if args.account:
        _print_account(ranks)
    speedups = {}
    for name in LAYOUTS:
        (even, _, _), (uneven, split, _) = got[name, False], got[name, True]
        speedups[name] = even / uneven
        print(f"{name}: even {even:.4g} s/step, in proportion to speed {uneven:.4g} s/step "
              f"({'micro-batches per rank' if name == 'dp2' else 'blocks per stage'} {split})")
    print(f"pp2 predicted by the planner's simulator: {predicted_pipeline(args):.2f}x")
    print(f"speedup of the split in proportion to speed: dp2 {speedups['dp2']:.2f}x, pp2 {speedups['pp2']:.2f}x")


def _print_account(ranks: list[dict]) -> None:
    """Per rank and configuration, medians over the steps, in ms: the step, the blocks' device time, the CPU
    of their math (inside that time), the CPU outside the blocks (embedding, head, loss, optimizer, runtime),
    the oversleep not taken back, and the rest (waiting for the other rank, messages)."""
    print("rank  layout  split    step   blocks' device  their math  CPU outside  oversleep  rest (ms per step)")
    for key in ranks[0]:
        for r, got in enumerate(ranks):
            wall, device, math, outside, late = (1e3 * v for v in got[key][2])
            print(f"{r:>4}  {key[0]:<6}  {'speed' if key[1] else 'even':<6} {wall:6.1f}  {device:14.1f}  {math:10.1f}  "
                  f"{outside:11.1f}  {late:9.1f}  {wall - device - outside - late:5.1f}")


if __name__ == "__main__":
    main()
