"""parallel.tp_overlap against plain Megatron TP + SP on a slow tp link: how much of the exposed tp
communication the ring decomposition hides (tessel.parallel.tensor.overlap, Wang et al. 2023).

Two emulated nodes of one rank each (tessel.testing.emulator: network namespaces, a veth link shaped by tc
tbf), so tp2's sequence all-gathers and reduce-scatters cross the shaped link. Each rank trains the reference
GPT (tp2, sequence_parallel) through tessel.parallelize, plain and overlapped, built from the same seed; their
forward+backward steps alternate round by round so that the machine's load hits both alike. Compute is the
CPU's own matmuls (one thread a rank).

The run is made twice: once on the shaped link, once unshaped (the veth at memory speed: its tp
communication costs next to nothing), and per mode the median step time is taken. Exposed tp communication
per step = step time on the slow link - plain's step time on the fast one (the compute and everything else,
so overlap's own overhead, its smaller matmuls and messages, counts as exposed). Hidden share = 1 - exposed
overlapped / exposed plain. The last line prints it with the tokens/s ratio overlapped / plain.

    PYTHONPATH=$PWD python benchmarks/tp_overlap.py [--rate 300mbit] [--steps 7]   # needs root (netns, tc)

With a GPU and NCCL, torch's fused symmetric-memory kernels (fused_all_gather_matmul /
fused_matmul_reduce_scatter) are the comparison to add: not measurable here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

MODES = ("plain", "overlap")


def _config(args, overlap: bool):
    from tessel.config import build_config
    raw = {"model": {"vocab_size": args.vocab, "n_layer": args.layers, "n_head": args.heads, "d_model": args.d_model,
                     "max_seq_len": args.seq},
           "parallel": {"tp": 2, "sequence_parallel": True, "tp_overlap": overlap},
           "train": {"steps": args.steps + 1, "global_batch": args.batch, "seq_len": args.seq, "warmup_steps": 0,
                     "eval_every": 0, "sample_tokens": 0},
           "data": {"source": "synthetic"},
           "logging": {"progress": False, "tensorboard": False, "out_dir": tempfile.mkdtemp(prefix="tessel-ov-")},
           "fault": {"heartbeat_s": 0}}
    return build_config(raw)


def _runner(args, overlap: bool):
    import torch
    from tessel.apply import parallelize
    from tessel.mesh import make_mesh
    from tessel.models.build import build_model
    cfg = _config(args, overlap)
    torch.manual_seed(cfg.train.seed)
    model = build_model(cfg.model)
    return model, parallelize(model, make_mesh(cfg.parallel.axis_sizes), cfg)


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from tessel.runtime import init_distributed, shutdown_and_exit
    init_distributed()
    built = {mode: _runner(args, mode == "overlap") for mode in MODES}
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
    times, losses = {m: [] for m in MODES}, {}
    for step in range(args.steps + 1):  # the first round warms connections and allocators up
        for mode, (model, runner) in built.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = runner.forward_backward(x, y)
            t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the step ends when its slowest rank does
            model.zero_grad(set_to_none=True)
            losses.setdefault(mode, float(loss))
            if step:
                times[mode].append(t.item())
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps({"times": times, "losses": losses}))
    shutdown_and_exit(0)


def one_run(args, rate: str | None) -> dict:
    from tessel.testing.emulator import Emulator
    out = Path(tempfile.mkdtemp(prefix="tessel-bench-")) / "tp_overlap.json"
    argv = [str(Path(__file__).resolve()), "--worker", "--out", str(out), *_shape_argv(args)]
    with Emulator(nodes=2, nproc_per_node=1, rate=rate, queue_latency=args.queue_latency) as emu:
        runs = emu.run(argv, timeout=900)
    if any(r.returncode for r in runs) or not out.exists():
        for r in runs:
            print(f"--- node {r.node} exit {r.returncode}\n{r.log[-4000:]}", file=sys.stderr)
        raise SystemExit(1)
    return json.loads(out.read_text())


def _shape_argv(args) -> list[str]:
    return [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("steps", "d_model", "layers", "heads", "seq",
                                                                    "batch", "vocab")]


def report(args, slow: dict, fast: dict) -> None:
    med = lambda run, m: statistics.median(run["times"][m])  # noqa: E731
    base = med(fast, "plain")  # compute and everything but the link
    exposed = {m: med(slow, m) - base for m in MODES}
    tokens = args.batch * args.seq
    print(f"tp2 + SP over 2 emulated nodes, tp link tbf {args.rate} each way; GPT d_model {args.d_model}, "
          f"{args.layers} layers, {args.batch} x {args.seq} tokens; median of {args.steps} fwd+bwd steps")
    print(f"first losses: slow {slow['losses']}, fast {fast['losses']}")
    print(f"{'mode':>8} {'slow link (ms)':>15} {'fast link (ms)':>15} {'exposed tp comm (ms)':>21} {'tokens/s':>9}")
    for m in MODES:
        print(f"{m:>8} {med(slow, m) * 1e3:>15.1f} {med(fast, m) * 1e3:>15.1f} {exposed[m] * 1e3:>21.1f} "
              f"{tokens / med(slow, m):>9.0f}")
    hidden = 1 - exposed["overlap"] / exposed["plain"] if exposed["plain"] > 0 else float("nan")
    print(f"overlap hides {hidden:.0%} of the exposed tp communication; tokens/s overlap / plain "
          f"{med(slow, 'plain') / med(slow, 'overlap'):.2f}x")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="300mbit", help="tbf rate of the tp link, each way")
    ap.add_argument("--queue-latency", default="50ms")
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return 0
    from tessel.testing.emulator import require_root
    why = require_root()
    if why:
        print(f"skipped: {why}")
        return 1
    slow, fast = one_run(args, args.rate), one_run(args, None)
    report(args, slow, fast)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
