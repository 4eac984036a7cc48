"""Collectives on a cluster's network: how long one takes, and how long it holds each link.

A group's Geometry (tessel.planner.cluster.group_geometry) says how it lies on
the nodes: n members, k on each node, N nodes. Inside one node every collective
is NCCL's ring over NVLink/NVSwitch (Thakur et al. 2005's alpha-beta ring; the
bus-bandwidth factors of nccl-tests). Across nodes:

- Rail-optimised nodes (`rails`; NVIDIA DGX SuperPOD reference architecture):
  GPU i of every node sits on rail switch i behind its own NIC. A collective
  runs hierarchically, as NCCL does with one channel per rail: inside the
  node over NVLink, and across nodes each of the k members carries 1/k of the
  data on its own rail, rail-aligned. The two phases are pipelined chunk by
  chunk, so the slower one sets the pace.
- Without rails, a group's ring leaves each node through one network path (a
  node with one NIC, or NICs NCCL cannot align into rails): the whole buffer
  crosses every node boundary at one NIC's rate, as a flat ring over n.
- All-reduce across nodes is NCCL's ring or its double binary tree (Jeaugey,
  "Massively Scale Your Deep Learning Training with NCCL 2.4", NVIDIA 2019:
  the tree's latency grows with log2 N, not N), whichever is faster. With
  SHARP (`sharp`; Graham et al. 2016, "Scalable Hierarchical Aggregation
  Protocol") the switches reduce: each node sends its data once and receives
  the result once, and the latency is one trip up and down the switch tree.
- All-to-all across nodes sends each peer its share directly; with PXN (`pxn`,
  needs rails; "Doubling all2all Performance with NVIDIA Collective
  Communication Library 2.12", NVIDIA 2022) data for GPU j of another node
  first moves over NVLink to the local GPU on j's rail, which sends one
  message per node: N-1 network messages instead of n-k, all rail-aligned.
- Point-to-point between nodes (pipeline stages) is rail-aligned by tessel's
  rank order: GPU i of a stage sends to GPU i of the next.

Each Cost also says how long the collective holds the device's NVLink and its
NIC (bandwidth time, latency excluded): the cost model and the simulator add
these up per link, and a step is never shorter than its busiest link.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.planner.cluster import Cluster, Geometry, Link


@dataclass(frozen=True)
class Cost:
    seconds: float
    nvlink_s: float = 0.0  # how long the collective keeps the device's NVLink busy (intra-node link)
    nic_s: float = 0.0  # ... and its share of the node's NICs (inter-node link)

    def times(self, count: float) -> "Cost":
        return Cost(self.seconds * count, self.nvlink_s * count, self.nic_s * count)

    def __add__(self, other: "Cost") -> "Cost":
        return Cost(self.seconds + other.seconds, self.nvlink_s + other.nvlink_s, self.nic_s + other.nic_s)


NONE = Cost(0.0)

# ring traffic per member, as a fraction of the buffer (all_gather: the output, reduce_scatter: the input)
RING_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
               "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n,
               # a pipelined chain (NCCL's broadcast and reduce rings): every link carries the whole buffer
               "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0}
RING_STEPS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
              "reduce_scatter": lambda n: n - 1, "all_to_all": lambda n: n - 1,
              "broadcast": lambda n: n - 1, "reduce": lambda n: n - 1}


def ring(op: str, nbytes: float, n: int, link: Link) -> tuple[float, float]:
    """(bandwidth seconds, latency seconds) of a ring collective over n members on `link`."""
    if n <= 1:
        return 0.0, 0.0
    return RING_FACTOR[op](n) * nbytes / link.rate, RING_STEPS[op](n) * link.latency


def collective(op: str, nbytes: float, geo: Geometry, cluster: Cluster) -> Cost:
    """One collective of `nbytes` (tessel.planner.traffic's size convention) over a group shaped `geo`."""
    if geo.n <= 1:
        return NONE
    nv, ib = cluster.intra, cluster.inter
    if op == "p2p":
        link = ib if geo.nodes > 1 else nv
        busy = nbytes / link.rate
        return Cost(link.latency + busy, 0.0 if geo.nodes > 1 else busy, busy if geo.nodes > 1 else 0.0)
    if geo.nodes == 1:
        bw, lat = ring(op, nbytes, geo.n, nv)
        return Cost(bw + lat, bw, 0.0)
    if op == "all_to_all":
        return _all_to_all(nbytes, geo, cluster)
    if op == "all_reduce":
        return _all_reduce(nbytes, geo, cluster)
    return _gather_scatter(op, nbytes, geo, cluster)


def _all_reduce(nbytes: float, geo: Geometry, cl: Cluster) -> Cost:
    n, k, N = geo.n, geo.k, geo.nodes
    nv, ib = cl.intra, cl.inter
    hierarchical = cl.rails and k > 1
    # the part each member sends across nodes: 1/k of the buffer on its own rail, or all of it
    part = nbytes / k if hierarchical else nbytes
    if cl.sharp:  # the switches reduce: the node's data goes up once and the result comes down once
        inter_bw, inter_lat = part / ib.rate, 2 * ib.latency
    else:
        ring_bw, ring_lat = (ring("all_reduce", part, N, ib) if hierarchical
                             else ring("all_reduce", nbytes, n, ib))
        tree_bw, tree_lat = 2 * part / ib.rate, 2 * math.ceil(math.log2(N)) * ib.latency
        inter_bw, inter_lat = min((ring_bw, ring_lat), (tree_bw, tree_lat), key=sum)
    intra_bw, intra_lat = ((2 * (k - 1) / k * nbytes / nv.rate, 2 * (k - 1) * nv.latency)
                           if k > 1 and (hierarchical or cl.sharp) else (0.0, 0.0))
    return Cost(max(intra_bw, inter_bw) + intra_lat + inter_lat, intra_bw, inter_bw)


def _gather_scatter(op: str, nbytes: float, geo: Geometry, cl: Cluster) -> Cost:
    """All-gather, reduce-scatter, broadcast or reduce across nodes (NCCL runs them as rings)."""
    n, k, N = geo.n, geo.k, geo.nodes
    nv, ib = cl.intra, cl.inter
    if cl.rails and k > 1:
        intra_bw, intra_lat = ring(op, nbytes, k, nv)
        inter_bw, inter_lat = ring(op, nbytes / k, N, ib)
        return Cost(max(intra_bw, inter_bw) + intra_lat + inter_lat, intra_bw, inter_bw)
    bw, lat = ring(op, nbytes, n, ib)
    return Cost(bw + lat, 0.0, bw)


def _all_to_all(nbytes: float, geo: Geometry, cl: Cluster) -> Cost:
    """Each member sends 1/n of its buffer to every member: (k-1)/n of it inside the node, (n-k)/n out."""
    n, k, N = geo.n, geo.k, geo.nodes
    nv, ib = cl.intra, cl.inter
    inter_bw = nbytes * (n - k) / n / ib.rate
    if cl.pxn and cl.rails and k > 1:
        # phase 1: to each local peer, what is bound for its rail on every node; phase 2: one message per node
        intra_bw = nbytes * (k - 1) / k / nv.rate
        latency = (k - 1) * nv.latency + (N - 1) * ib.latency
    else:
        intra_bw = nbytes * (k - 1) / n / nv.rate
        latency = (k - 1) * nv.latency + (n - k) * ib.latency
    return Cost(max(intra_bw, inter_bw) + latency, intra_bw, inter_bw)
