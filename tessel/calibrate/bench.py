"""`tessel bench comm`: collective timings in the manner of nccl-tests.

For each operation, algorithm and size: time per call (median over
iterations of the slowest rank), algbw = size / time and busbw = algbw x the
operation's factor, which makes numbers comparable with the link speed
(nccl-tests' PERFORMANCE.md): all-reduce 2(n-1)/n; all-gather,
reduce-scatter and all-to-all (n-1)/n. `size` is the whole buffer: the
all-reduce tensor, the all-gather output, the reduce-scatter input, what one
rank sends in all-to-all.
"""

from __future__ import annotations

import json
import os
import statistics
from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.distributed as dist

from tessel.comm import algorithms as A
from tessel.comm import all_to_all as X
from tessel.comm.topology import Topology, resolve_nodes
from tessel.config import ConfigError, at_least, output_file
from tessel.observe.metrics import synced_seconds
from tessel.runtime import init_distributed, shutdown_and_exit

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")
ALGORITHMS = {
    "all_reduce": ("native", "ring", "hierarchical"),
    "all_gather": ("native", "ring"),
    "reduce_scatter": ("native", "ring"),
    "all_to_all": ("native", "hierarchical"),
}


def bus_factor(op: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def parse_size(text: str) -> int:
    """'16M' -> 16 MiB in bytes; K, M, G suffixes are powers of 1024."""
    body = text.strip().upper().removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(body[-1:], 1)
    try:
        size = int(float(body[:-1] if mult > 1 else body) * mult)
    except (ValueError, OverflowError):  # not a number, or nan / inf
        raise ConfigError("--sizes", f"'{text}' is not a size like 4K, 1M or 16M") from None
    if size < 1:
        raise ConfigError("--sizes", f"'{text}' is less than one byte")
    return size


def check_args(world: int, ops: str, algorithms: str, sizes: str, iters: int, warmup: int,
               topology: str | None, node_size: int | None, json_out: str | None, under_torchrun: bool = False):
    """Every flag of `tessel bench comm`, checked before a rank is spawned (and again in each rank).

    under_torchrun: this process is a rank (tessel.commands.launch.under_torchrun), so the world is torchrun's.
    Returns the parsed (ops, algorithms, sizes); an empty algorithm list means all of them."""
    at_least("--world", world, 1)
    at_least("--iters", iters, 1)
    at_least("--warmup", warmup, 0)
    op_list, algos = parse_ops(ops, algorithms)
    size_list = [parse_size(x) for x in sizes.split(",")]
    check_nodes(ranks(world, under_torchrun), topology, node_size)
    if json_out is not None:
        output_file("--json", json_out)
    return op_list, algos, size_list


def parse_ops(ops: str, algorithms: str) -> tuple[list[str], list[str]]:
    """--ops and --algorithms as lists of known names, at least one pair of them measurable."""
    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    algos = [a.strip() for a in algorithms.split(",") if a.strip()]
    bad = [o for o in op_list if o not in ALGORITHMS]
    if bad or not op_list:
        raise ConfigError("--ops", f"unknown op(s) {bad or ops!r}; choose from {', '.join(OPS)}")
    known = sorted({a for names in ALGORITHMS.values() for a in names})
    bad = [a for a in algos if a not in known]
    if bad:
        raise ConfigError("--algorithms", f"unknown algorithm(s) {bad}; choose from {', '.join(known)}")
    if algos and not any(a in ALGORITHMS[o] for o in op_list for a in algos):
        raise ConfigError("--algorithms", f"none of {algos} implements {', '.join(op_list)} (an empty table)")
    return op_list, algos


def ranks(world: int, under_torchrun: bool) -> int:
    """The ranks the benchmark runs on: torchrun's world when already under it, else --world."""
    return int(os.environ["WORLD_SIZE"]) if under_torchrun else world


def check_nodes(world: int, topology: str | None, node_size: int | None) -> None:
    """--topology (a file `tessel probe` wrote for this world) or --node-size (dividing it)."""
    described = _load_topology(topology).world_size if topology is not None else world
    if described != world:
        raise ConfigError("--topology", f"{topology} describes {described} ranks, the benchmark runs {world}")
    at_least("--node-size", node_size, 1)
    if node_size is not None and world % node_size:
        raise ConfigError("--node-size", f"{node_size} does not divide the {world} ranks")


def _load_topology(path: str) -> Topology:
    try:
        return Topology.load(path)
    except OSError as err:
        raise ConfigError("--topology", f"cannot read {path}: {err.strerror}") from None
    except (ValueError, TypeError, AttributeError) as err:  # bad JSON, bad fields, not a JSON object
        raise ConfigError("--topology", f"{path} is not a topology file from `tessel probe`: {err}") from None


@dataclass
class Row:
    op: str
    algorithm: str
    size: int  # bytes
    count: int  # elements
    time_us: float
    algbw: float  # GB/s
    busbw: float  # GB/s


def make_call(op: str, algorithm: str, size: int, nodes, dev, dtype=torch.float32) -> Callable[[], object]:
    """A zero-argument closure that runs one collective of `size` bytes."""
    n, rank = dist.get_world_size(), dist.get_rank()
    count = max(1, size // torch.tensor([], dtype=dtype).element_size())
    if op == "all_reduce":
        buf = torch.ones(count, dtype=dtype, device=dev)
        fn = {"native": lambda: A.native_all_reduce(buf), "ring": lambda: A.ring_all_reduce(buf),
              "hierarchical": lambda: A.hierarchical_all_reduce(buf, nodes)}[algorithm]
        return fn
    per = max(1, count // n)
    if op in ("all_gather", "reduce_scatter"):
        big = torch.ones(per * n, dtype=dtype, device=dev)
        small = torch.ones(per, dtype=dtype, device=dev)
        if op == "all_gather":
            return (lambda: A.native_all_gather(big, small)) if algorithm == "native" else \
                (lambda: A.ring_all_gather(big, small))
        return (lambda: A.native_reduce_scatter(small, big)) if algorithm == "native" else \
            (lambda: A.ring_reduce_scatter(small, big))
    ins = [torch.full((per,), float(rank), dtype=dtype, device=dev) for _ in range(n)]
    outs = [torch.empty(per, dtype=dtype, device=dev) for _ in range(n)]
    return (lambda: X.native_all_to_all(outs, ins)) if algorithm == "native" else \
        (lambda: X.hierarchical_all_to_all(outs, ins, nodes))


def time_call(call: Callable[[], object], iters: int, warmup: int, dev) -> float:
    """Median seconds per call, of the slowest rank (each iteration starts after a barrier)."""
    for _ in range(warmup):
        call()
    times = []
    for _ in range(iters):
        dist.barrier()
        times.append(synced_seconds(call, dev))
    t = torch.tensor([statistics.median(times)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def run(ops, algorithms, sizes, nodes, iters: int = 5, warmup: int = 1, dev=None) -> list[Row]:
    dev = dev or torch.device("cpu")
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for algo in ALGORITHMS[op]:
            if algorithms and algo not in algorithms:
                continue
            for size in sizes:
                call = make_call(op, algo, size, nodes, dev)
                t = time_call(call, iters, warmup, dev)
                nbytes = _bytes(op, size, n)
                algbw = nbytes / t / 1e9
                rows.append(Row(op, algo, nbytes, nbytes // 4, t * 1e6, algbw, algbw * bus_factor(op, n)))
    return rows


def _bytes(op: str, size: int, n: int) -> int:
    count = max(1, size // 4)
    return count * 4 if op == "all_reduce" else max(1, count // n) * n * 4


def format_table(rows: list[Row], n: int, nodes) -> str:
    head = (f"# tessel bench comm: {n} ranks, nodes {nodes}, float32; time = median over iterations of "
            f"the slowest rank\n# busbw factor: all_reduce 2(n-1)/n = {bus_factor('all_reduce', n):.3f}; "
            f"others (n-1)/n = {bus_factor('all_gather', n):.3f}")
    cols = f"{'op':>15} {'algorithm':>13} {'size(B)':>12} {'count':>10} {'time(us)':>11} " \
           f"{'algbw(GB/s)':>12} {'busbw(GB/s)':>12}"
    lines = [head, cols]
    for r in rows:
        lines.append(f"{r.op:>15} {r.algorithm:>13} {r.size:>12} {r.count:>10} {r.time_us:>11.1f} "
                     f"{r.algbw:>12.3f} {r.busbw:>12.3f}")
    return "\n".join(lines)


def run_rank(ops, algorithms, sizes, iters, warmup, topology: str | None, nproc_per_node: int | None,
             json_out: str | None = None) -> None:
    """Entry point of one rank under torchrun."""
    dev = init_distributed()
    nodes = resolve_nodes(dist.get_world_size(), topology, nproc_per_node)
    rows = run(ops, algorithms, sizes, nodes, iters, warmup, dev)
    if dist.get_rank() == 0:
        print(format_table(rows, dist.get_world_size(), nodes), flush=True)
        if json_out:
            with open(json_out, "w") as f:
                json.dump({"nodes": nodes, "rows": [asdict(r) for r in rows]}, f, indent=1)
    shutdown_and_exit(0)
