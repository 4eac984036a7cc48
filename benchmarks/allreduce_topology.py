"""Hierarchical vs flat ring all-reduce on an emulated 2-node x 2-rank cluster (1 Gbit/s between nodes).

    sudo PYTHONPATH=. python benchmarks/allreduce_topology.py [--rate 1gbit] [--iters 7]

Runs on the multi-node emulator (tessel.comm.emulator: network namespaces,
tbf-shaped veths, one torchrun per node). Every size times tessel's flat ring,
tessel's hierarchical all-reduce and gloo's own all-reduce (the PyTorch peer),
interleaved per iteration so machine noise hits all three alike; medians of the
slowest rank. The last line is the flat-ring / hierarchical time ratio at 16 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

SIZES_MB = (1, 4, 16)
ALGOS = ("ring", "hierarchical", "native")


def worker(out: str, iters: int) -> None:
    import torch
    import torch.distributed as dist

    from tessel.comm import algorithms as A
    from tessel.comm.topology import resolve_nodes
    from tessel.runtime import init_distributed, shutdown_and_exit

    init_distributed()
    n = dist.get_world_size()
    nodes = resolve_nodes(n)  # torchrun: LOCAL_WORLD_SIZE ranks per node
    where = [None] * n
    dist.all_gather_object(where, os.environ.get("TESSEL_EMU_NODE"))
    assert all(len({where[r] for r in node}) == 1 for node in nodes), f"placement {where} vs nodes {nodes}"
    run = {"ring": lambda b: A.ring_all_reduce(b), "hierarchical": lambda b: A.hierarchical_all_reduce(b, nodes),
           "native": lambda b: dist.all_reduce(b)}
    results = {}
    for mb in SIZES_MB:
        buf = torch.ones(mb * 2**20 // 4)
        times = {a: [] for a in ALGOS}
        for it in range(iters + 1):  # the first round warms connections up
            for algo in ALGOS:
                dist.barrier()
                t0 = time.perf_counter()
                run[algo](buf)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if it:
                    times[algo].append(t.item())
        # every call summed 4 equal buffers: exactly 4**calls everywhere (powers of 4 are exact in fp32)
        assert torch.equal(buf, torch.full_like(buf, 4.0 ** ((iters + 1) * len(ALGOS)))), "wrong sum"
        results[mb] = {a: statistics.median(v) for a, v in times.items()}
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"nodes": nodes, "results": results}))
    shutdown_and_exit(0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.iters)
        return 0
    from tessel.comm.emulator import Emulator, cleanup_stale, require_root
    why = require_root()
    if why:
        print(f"skipped: {why}")
        return 1
    cleanup_stale()
    out = Path(tempfile.mkdtemp(prefix="tessel-bench-")) / "allreduce.json"
    with Emulator(nodes=2, nproc_per_node=2, rate=args.rate) as emu:
        runs = emu.run([str(Path(__file__).resolve()), "--worker", "--out", str(out), "--iters", str(args.iters)],
                       timeout=900)
    if any(r.returncode for r in runs) or not out.exists():
        for r in runs:
            print(f"--- node {r.node} exit {r.returncode}\n{r.log[-4000:]}", file=sys.stderr)
        return 1
    data = json.loads(out.read_text())
    n = 4
    print(f"emulated cluster: nodes {data['nodes']}, inter-node links tbf {args.rate} each way; "
          f"median of {args.iters} (slowest rank); the machine is shared, timings are noisy")
    print(f"{'size':>8} {'algorithm':>13} {'time(ms)':>10} {'busbw(Gbit/s)':>14}")
    for mb, row in data["results"].items():
        for algo, t in row.items():
            busbw = int(mb) * 2**20 * 8 / t / 1e9 * 2 * (n - 1) / n
            print(f"{mb + 'MiB':>8} {algo:>13} {t * 1e3:>10.1f} {busbw:>14.3f}")
    for mb, row in data["results"].items():
        print(f"{mb}MiB: ring/hierarchical {row['ring'] / row['hierarchical']:.2f}x, "
              f"native(gloo)/hierarchical {row['native'] / row['hierarchical']:.2f}x")
    row = data["results"][str(SIZES_MB[-1])]
    print(f"flat ring / hierarchical time at 16 MiB: {row['ring'] / row['hierarchical']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
