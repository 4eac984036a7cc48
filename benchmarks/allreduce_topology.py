"""Hierarchical vs flat ring all-reduce on an emulated 2-node x 2-rank cluster (1 Gbit/s between nodes).

    sudo PYTHONPATH=. python benchmarks/allreduce_topology.py [--rate 1gbit] [--iters 7] [--runs 3]
        [--congestion reno] [--queue-latency 10ms]

Runs on the multi-node emulator (tessel.testing.emulator: network namespaces,
tbf-shaped veths, one torchrun per node). Every size times tessel's flat ring
(ranks in order: 0 1 | 2 3, so the ring crosses between nodes twice, the
fewest any ring can), tessel's hierarchical all-reduce and gloo's own
all-reduce (the PyTorch peer), interleaved per iteration so machine noise hits
all three alike; time of the slowest rank. `--runs` repeats the whole
measurement on fresh emulators; each run's medians are printed, then the
medians over all iterations of all runs (and the best, the fastest iteration:
a loaded machine only ever slows an iteration down).

Uplink use: bytes each node must push through its uplink to the other node,
over the time, against the line rate. The flat ring pushes 2(n-1)/n S = 1.5 S
(the rank whose ring successor is on the other node sends that much);
hierarchical pushes S (each of the L local ranks sends its S/L part);
gloo's all-reduce is counted as a ring in rank order (1.5 S). TCP/IP and
Ethernet headers take ~4.4% of the line (1448 payload bytes per 1514-byte
frame), so ~96% is the most a payload measure can show.
The last line is the flat-ring / hierarchical time ratio at 16 MiB.
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

SIZES_MB = (1, 4, 16, 64)
UPLINK_BYTES = {"ring": 1.5, "hierarchical": 1.0, "native": 1.5}  # x S per node uplink, 2 nodes x 2 ranks
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
                buf.fill_(float(dist.get_rank() + 1))
                dist.barrier()
                t0 = time.perf_counter()
                run[algo](buf)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                if it:
                    times[algo].append(t.item())
                assert torch.equal(buf, torch.full_like(buf, 10.0)), f"{algo}: wrong sum"  # 1+2+3+4, exact
        results[mb] = times
    if dist.get_rank() == 0:
        Path(out).write_text(json.dumps({"nodes": nodes, "results": results}))
    shutdown_and_exit(0)


def rate_bits(rate: str) -> float:
    """tc's rate syntax (SI units, as tc reads them): 1gbit -> 1e9, 100mbit -> 1e8."""
    units = {"gbit": 1e9, "mbit": 1e6, "kbit": 1e3, "bit": 1.0}
    for unit, mult in units.items():
        if rate.lower().endswith(unit):
            return float(rate[: -len(unit)]) * mult
    raise ValueError(f"rate {rate!r}: expected e.g. 1gbit or 500mbit")


def one_run(args) -> dict:
    from tessel.testing.emulator import Emulator
    out = Path(tempfile.mkdtemp(prefix="tessel-bench-")) / "allreduce.json"
    with Emulator(nodes=2, nproc_per_node=2, rate=args.rate, queue_latency=args.queue_latency,
                  congestion=args.congestion) as emu:
        runs = emu.run([str(Path(__file__).resolve()), "--worker", "--out", str(out), "--iters", str(args.iters)],
                       timeout=900)
    if any(r.returncode for r in runs) or not out.exists():
        for r in runs:
            print(f"--- node {r.node} exit {r.returncode}\n{r.log[-4000:]}", file=sys.stderr)
        raise SystemExit(1)
    return json.loads(out.read_text())


def report(all_times: dict, rate: str, n: int = 4) -> None:
    line = rate_bits(rate)
    print(f"{'size':>8} {'algorithm':>13} {'time(ms)':>10} {'algbw(Gbit/s)':>14} {'busbw(Gbit/s)':>14} "
          f"{'uplink use':>11} {'best(ms)':>9} {'best use':>9}")
    for mb, row in all_times.items():
        for algo, ts in row.items():
            t, best, size = statistics.median(ts), min(ts), int(mb) * 2**20
            algbw = size * 8 / t / 1e9
            use = lambda x: UPLINK_BYTES[algo] * size * 8 / x / line  # noqa: E731
            print(f"{mb + 'MiB':>8} {algo:>13} {t * 1e3:>10.1f} {algbw:>14.3f} {algbw * 2 * (n - 1) / n:>14.3f} "
                  f"{use(t):>10.0%} {best * 1e3:>9.1f} {use(best):>8.0%}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", default="1gbit")
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--runs", type=int, default=1, help="fresh emulators, each timing --iters rounds")
    ap.add_argument("--congestion", default=None, help="TCP congestion control in the nodes (default: the host's)")
    ap.add_argument("--queue-latency", default="50ms", help="tbf queue bound of the inter-node links")
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        worker(args.out, args.iters)
        return 0
    from tessel.testing.emulator import cleanup_stale, require_root
    why = require_root()
    if why:
        print(f"skipped: {why}")
        return 1
    cleanup_stale()
    merged: dict = {}
    key = str(SIZES_MB[-2])  # 16 MiB
    per_run = []
    for k in range(args.runs):
        data = one_run(args)
        meds = {a: statistics.median(ts) for a, ts in data["results"][key].items()}
        per_run.append(meds["ring"] / meds["hierarchical"])
        print(f"run {k}: nodes {data['nodes']}; 16MiB medians (ms) "
              + ", ".join(f"{a} {t * 1e3:.1f}" for a, t in meds.items())
              + f"; ring/hierarchical {per_run[-1]:.2f}x", flush=True)
        for mb, row in data["results"].items():
            for algo, ts in row.items():
                merged.setdefault(mb, {}).setdefault(algo, []).extend(ts)
    print(f"emulated cluster: 2 nodes x 2 ranks, inter-node links tbf {args.rate} each way (queue "
          f"{args.queue_latency}, TCP congestion control {args.congestion or 'the host default'}); medians of "
          f"{args.runs} run(s) x {args.iters} iterations (slowest rank); the machine is shared, timings are noisy")
    report(merged, args.rate)
    for mb, row in merged.items():
        ring, hier, native = (statistics.median(row[a]) for a in ALGOS)
        print(f"{mb}MiB: ring/hierarchical {ring / hier:.2f}x, native(gloo)/hierarchical {native / hier:.2f}x")
    print(f"per-run ring/hierarchical at 16 MiB: {', '.join(f'{r:.2f}x' for r in per_run)}; best (min) times: "
          f"{min(merged[key]['ring']) / min(merged[key]['hierarchical']):.2f}x")
    row = merged[key]
    print(f"flat ring / hierarchical time at 16 MiB: "
          f"{statistics.median(row['ring']) / statistics.median(row['hierarchical']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    raise SystemExit(main())
