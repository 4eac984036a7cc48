"""2D, 2.5D and 3D tensor parallelism against Megatron's 1D on the same model and 8 ranks.

Each layout trains the reference GPT through tessel's own trainer step (tessel.parallelize, AdamW) from the
same seed on the same batches: 1D tp8 against 2.5D (2x2x2) and 3D (2x2x2); and, because 2D needs a square,
dp2 x 2D (2x2) against dp2 x 1D tp4. All layouts run in one spawn of 8 ranks, their steps interleaved round
by round so that load on the machine hits each alike. Printed per layout: the median step time, the
first-step loss (the same model: equal within fp32 rounding), the parameter and residual-stream bytes one
rank holds, and the measured peak memory of a step; last, each grid mode's time and peak-memory ratios
against its 1D peer (< 1: the grid mode is faster, or smaller).

Peak memory, measured: one more step of each layout runs under torch.profiler with profile_memory, which
records every allocation and free of torch's CPU allocator (the running total its [memory] events carry);
the step's peak is the tensors live when it starts (parameters, AdamW's state: summed) plus the highest
that running total reaches (activations kept for backward, gradients, the collectives' torch buffers,
temporaries). The median over the 8 ranks is printed (the max too). Not counted: gloo's own transport
buffers and the Python heap, which are outside torch's allocator; the process's RSS is not used because all
layouts share each rank's process.

Measured here (2 CPU cores shared with other work, load 10-15, 8 gloo ranks, d_model 256, 4 layers, batch
16 x 64, 8 timed steps): 1d tp8 851 ms, 2.5d 1118 ms (1.31x), 3d 957 ms (1.12x); dp2 x 1d tp4 495 ms, dp2 x 2d
1000 ms (2.02x). Peak step memory per rank (median of 8): 1d tp8 44.5 MiB, 2.5d 26.6 MiB (0.60x), 3d 30.7 MiB
(0.69x); dp2 x 1d tp4 38.0 MiB, dp2 x 2d 27.5 MiB (0.73x). The residual stream per rank 0.12x (2.5D, 3D) and
0.25x (2D) of 1D's, parameters 1.00x (3D, 2D) and 1.99x (2.5D keeps a copy per depth layer).

On CPU (gloo) this measures the algorithms' message counts and sizes on shared memory, not a GPU fabric:
SUMMA's q broadcasts per matmul cost latency that 1D's one all-reduce does not; the bytes per rank are what
shrink (python -m tessel.planner.tp_grid prints the per-layer formulas at 8-512 devices).

    PYTHONPATH=$PWD python benchmarks/tp_nd.py [--steps 8] [--d-model 256] [--layers 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from tessel.config import build_config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.apply import parallelize
from tessel.spawn import spawn
from tessel.train.trainer import Trainer

LAYOUTS = {
    "1d tp8": {"tp": 8},
    "2.5d 2x2x2": {"tp": 8, "tp_mode": "2.5d", "tp_depth": 2},
    "3d 2x2x2": {"tp": 8, "tp_mode": "3d"},
    "1d dp2 tp4": {"dp": 2, "tp": 4},
    "2d dp2 2x2": {"dp": 2, "tp": 4, "tp_mode": "2d"},
}
PEERS = {"2.5d 2x2x2": "1d tp8", "3d 2x2x2": "1d tp8", "2d dp2 2x2": "1d dp2 tp4"}


def _config(args, parallel: dict):
    raw = {"model": {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": parallel,
           "train": {"steps": args.steps + args.warmup, "global_batch": args.batch, "seq_len": args.seq,
                     "warmup_steps": 0, "eval_every": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"},
           "logging": {"progress": False, "tensorboard": False, "peak_flops": 1e9,
                       "out_dir": tempfile.mkdtemp(prefix="tessel-tp-nd-")},
           "fault": {"heartbeat_s": 0}}
    return build_config(raw)


def _build(args, parallel: dict):
    cfg = _config(args, parallel)
    mesh = make_mesh(cfg.parallel.axis_sizes)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    stream = {}
    model.layers[0].register_forward_pre_hook(
        lambda m, a: stream.__setitem__("bytes", a[0].numel() * a[0].element_size()))
    runner = parallelize(model, mesh, cfg)
    trainer = Trainer(cfg, mesh, runner, torch.distributed.get_rank())
    params = sum(p.numel() * p.element_size() for p in runner.parameters())
    return trainer, stream, params


def _bench(args) -> dict:
    built = {name: _build(args, parallel) for name, parallel in LAYOUTS.items()}
    times = {name: [] for name in LAYOUTS}
    first = {}
    for step in range(args.warmup + args.steps):  # round by round: every layout sees the same load
        for name, (trainer, _, _) in built.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            row = trainer.train_step(step)
            trainer.state.step = step + 1
            elapsed = time.perf_counter() - t0
            first.setdefault(name, row["loss"])
            if step >= args.warmup:
                times[name].append(elapsed)
    step = args.warmup + args.steps
    peaks = {}
    for name, (trainer, _, _) in built.items():  # untimed: the profiler slows the step it watches
        torch.distributed.barrier()
        peaks[name] = _peak_step_bytes(trainer, step)
        trainer.state.step = step + 1
    return {name: {"step_s": statistics.median(times[name]), "loss0": first[name], "params": built[name][2],
                   "stream": built[name][1]["bytes"], "peak": peaks[name]} for name in LAYOUTS}


def _live_bytes(trainer) -> int:
    """Bytes of the tensors a step starts with: parameters, their gradients if kept, AdamW's state."""
    runner = trainer.runner
    tensors = [p for p in runner.parameters()] + [p.grad for p in runner.parameters() if p.grad is not None]
    tensors += [t for state in trainer.state.optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def _peak_step_bytes(trainer, step: int) -> int:
    """One step under the profiler: the live tensors' bytes plus the peak of the allocator's running total
    (the profiler's [memory] events count from the moment it starts)."""
    from torch.profiler import ProfilerActivity, profile  # deferred: only the memory pass needs it

    live = _live_bytes(trainer)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        trainer.train_step(step)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
    totals = [e["args"]["Total Allocated"] for e in events if e.get("name") == "[memory]"]
    return live + max(totals, default=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    ranks = spawn(_bench, 8, args, timeout=1800)
    result = ranks[0]
    for name in LAYOUTS:  # peak memory: the median rank's (and the largest)
        peaks = sorted(r[name]["peak"] for r in ranks)
        result[name]["peak"], result[name]["peak_max"] = statistics.median(peaks), peaks[-1]
    kib, mib = 1024, 2**20
    print(f"{'layout':<14} {'step (ms)':>10} {'loss, step 1':>13} {'params/rank (KiB)':>18} {'stream/rank (KiB)':>18} "
          f"{'peak/rank (MiB), median / max':>30}")
    for name, r in result.items():
        print(f"{name:<14} {1000 * r['step_s']:>10.1f} {r['loss0']:>13.5f} {r['params'] / kib:>18.1f} "
              f"{r['stream'] / kib:>18.1f} {r['peak'] / mib:>21.2f} / {r['peak_max'] / mib:.2f}")
    for name, peer in PEERS.items():
        a, b = result[name], result[peer]
        print(f"{name} / {peer}: time {a['step_s'] / b['step_s']:.2f}x, peak memory {a['peak'] / b['peak']:.2f}x, "
              f"params {a['params'] / b['params']:.2f}x, stream {a['stream'] / b['stream']:.2f}x")


if __name__ == "__main__":
    main()
