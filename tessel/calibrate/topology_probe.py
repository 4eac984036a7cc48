"""`tessel probe`: bandwidth and latency between every pair of ranks, and which ranks share a node.

Pairs are measured one at a time (a barrier between pairs) so they never share
a link: latency is half the median round trip of a 1-element message;
bandwidth is a large message's bytes over the best (shortest) time until
the receiver's 1-element acknowledgement arrives, less one latency: stalls
of a busy machine only make a measurement slower. Both directions are
measured.

Node inference clusters the bandwidth matrix: take each pair's slower
direction, sort those values, and cut at the largest ratio between
neighbours; if that ratio is at least `gap` (default 2), pairs above the cut
are "same node" and nodes are the connected components. Without such a gap
all ranks form one node (a uniform network cannot tell nodes apart).

The topology file (JSON, tessel.comm.topology.Topology), format version 1:

    {
     "version": 1,
     "world_size": 4,
     "nodes": [[0, 1], [2, 3]],          # global ranks per node, ascending
     "bandwidth_gbps": [[0, 41.2, ...]], # [src][dst] in Gbit/s, diagonal 0
     "latency_us": [[0, 35.0, ...]],     # [src][dst] one-way, microseconds
     "intra_gbps": 41.2,                 # median over same-node pairs (null if none)
     "inter_gbps": 0.93,                 # median over cross-node pairs (null if none)
     "hosts": ["host/node0", ...],       # what each rank reported (informational only)
     "method": "probe"
    }

Readers: `Topology.load(path)`; DP's hierarchical all-reduce via
`runtime.topology` or $TESSEL_TOPOLOGY; the mesh via
`mesh.check_topology(topology.nproc_per_node)`; the planner via
intra_gbps / inter_gbps / latency_us.
"""

from __future__ import annotations

import math
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.comm.topology import Topology
from tessel.config import ConfigError, at_least, output_file
from tessel.runtime import init_distributed, shutdown_and_exit

TAG = 91


def _ping_pong(peer: int, first: bool, reps: int, dev) -> float:
    """Median round trip (s) of a 1-element message; `first` sends first."""
    x = torch.zeros(1, device=dev)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        if first:
            dist.send(x, peer, tag=TAG)
            dist.recv(x, peer, tag=TAG)
        else:
            dist.recv(x, peer, tag=TAG)
            dist.send(x, peer, tag=TAG)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _stream(peer: int, sender: bool, nbytes: int, reps: int, dev) -> float | None:
    """Bandwidth (Gbit/s) of sender -> peer, measured on the sender; None on the receiver."""
    big = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=dev)
    ack = torch.zeros(1, device=dev)
    times = []
    for _ in range(reps):
        if sender:
            dist.recv(ack, peer, tag=TAG)  # the receiver is ready: its recv is posted
            t0 = time.perf_counter()
            dist.send(big, peer, tag=TAG)
            dist.recv(ack, peer, tag=TAG)
            times.append(time.perf_counter() - t0)
        else:
            req = dist.irecv(big, peer, tag=TAG)
            dist.send(ack, peer, tag=TAG)
            req.wait()
            dist.send(ack, peer, tag=TAG)
    if not sender:
        return None
    # best of the repetitions: a stall (a descheduled rank) only ever lowers a measurement,
    # so the fastest one is the closest to what the link can do. The ack's latency stays
    # in: subtracting a latency measured under load can leave ~0 s and an absurd
    # bandwidth, while keeping it costs a few percent on a message this large.
    t = min(times)
    return big.numel() * 4 * 8 / t / 1e9


def measure(nbytes: int = 4 << 20, reps: int = 3, lat_reps: int = 10, device=None):
    """(bandwidth Gbit/s, latency us) matrices, identical on every rank. Collective."""
    rank, n = dist.get_rank(), dist.get_world_size()
    dev = device or torch.device("cpu")
    bw = torch.zeros(n, n, dtype=torch.float64)
    lat = torch.zeros(n, n, dtype=torch.float64)
    _ping_pong_warmup(rank, n, dev)
    for i in range(n):
        for j in range(i + 1, n):
            dist.barrier()
            if rank not in (i, j):
                continue
            peer, first = (j, True) if rank == i else (i, False)
            one_way = _ping_pong(peer, first, lat_reps, dev) / 2
            lat[rank, peer] = one_way * 1e6
            for src in (i, j):  # i -> j, then j -> i
                got = _stream(peer, rank == src, nbytes, reps, dev)
                if got is not None:
                    bw[rank, peer] = got
    dist.barrier()
    dist.all_reduce(bw)  # each entry was written by exactly one rank
    dist.all_reduce(lat)
    return bw.tolist(), lat.tolist()


def _ping_pong_warmup(rank: int, n: int, dev) -> None:
    """First messages pay for connection set-up; exchange one with everybody before timing."""
    x = torch.zeros(1, device=dev)
    for peer in range(n):
        if peer != rank:
            ops = [dist.P2POp(dist.isend, x, peer), dist.P2POp(dist.irecv, torch.zeros(1, device=dev), peer)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()


def infer_nodes(bw: list[list[float]], gap: float = 2.0) -> list[list[int]]:
    """Cluster ranks by bandwidth: cut at the largest ratio between sorted pair bandwidths."""
    n = len(bw)
    pair = {(i, j): min(bw[i][j], bw[j][i]) for i in range(n) for j in range(i + 1, n)}
    values = sorted(v for v in pair.values() if v > 0)
    if len(values) < 2:
        return [list(range(n))]
    ratios = [(values[k + 1] / values[k], k) for k in range(len(values) - 1)]
    best, k = max(ratios)
    if best < gap:
        return [list(range(n))]
    cut = math.sqrt(values[k] * values[k + 1])
    parent = list(range(n))

    def find(a):
        while parent[a] != a:
            parent[a] = parent[parent[a]]
            a = parent[a]
        return a

    for (i, j), v in pair.items():
        if v >= cut:
            parent[find(i)] = find(j)
    groups: dict[int, list[int]] = {}
    for r in range(n):
        groups.setdefault(find(r), []).append(r)
    return sorted(groups.values())


def _median_or_none(xs):
    return statistics.median(xs) if xs else None


def probe(out: str | Path | None = None, nbytes: int = 4 << 20, reps: int = 3, device=None) -> Topology:
    """Measure, infer nodes, and (rank 0) write the topology file. Collective."""
    bw, lat = measure(nbytes, reps, device=device)
    nodes = infer_nodes(bw)
    node_of = {r: k for k, ns in enumerate(nodes) for r in ns}
    n = len(bw)
    intra = [bw[i][j] for i in range(n) for j in range(n) if i != j and node_of[i] == node_of[j]]
    inter = [bw[i][j] for i in range(n) for j in range(n) if node_of[i] != node_of[j]]
    hosts: list = [None] * n
    me = socket.gethostname() + (f"/node{os.environ['TESSEL_EMU_NODE']}" if "TESSEL_EMU_NODE" in os.environ else "")
    dist.all_gather_object(hosts, me)
    topo = Topology(world_size=n, nodes=nodes, bandwidth_gbps=bw, latency_us=lat,
                    intra_gbps=_median_or_none(intra), inter_gbps=_median_or_none(inter), hosts=hosts,
                    method="probe")
    if out is not None and dist.get_rank() == 0:
        topo.save(out)
    return topo


def format_topology(topo: Topology) -> str:
    n = topo.world_size
    lines = [f"nodes: {topo.nodes}  (intra {_fmt(topo.intra_gbps)} Gbit/s, inter {_fmt(topo.inter_gbps)} Gbit/s)",
             "bandwidth Gbit/s [src][dst]:"]
    for i in range(n):
        lines.append("  " + " ".join(f"{topo.bandwidth_gbps[i][j]:8.2f}" for j in range(n)))
    lines.append("latency us [src][dst]:")
    for i in range(n):
        lines.append("  " + " ".join(f"{topo.latency_us[i][j]:8.1f}" for j in range(n)))
    return "\n".join(lines)


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


def check_args(world: int, out: str, size_mb: float, reps: int) -> None:
    """Every flag of `tessel probe`, checked before a rank is spawned."""
    at_least("--world", world, 1)
    if not (size_mb > 0 and math.isfinite(size_mb)):
        raise ConfigError("--size-mb", f"must be a positive number of MiB (got {size_mb})")
    at_least("--reps", reps, 1)
    output_file("--out", out)


def run_rank(out: str, size_mb: float, reps: int) -> None:
    """Entry point of one rank under torchrun."""
    dev = init_distributed()
    topo = probe(out, int(size_mb * 2**20), reps, device=dev)
    if dist.get_rank() == 0:
        print(format_topology(topo))
        print(f"wrote {out}", flush=True)
    shutdown_and_exit(0)
