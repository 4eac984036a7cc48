"""Slow ranks: a window of per-rank evidence names a persistently slow one, and fault.slow_policy acts.

Every step (every straggler_every steps under "warn") the ranks all-gather
the time of their forward passes (tessel.train.fault.stragglers.ForwardTimer:
their compute; backward is taken as twice the forward, as the planner and
the emulated devices do). A rank's idle time is what is left of the step:
the time it waited for the others in the step's collectives. Over
`slow_window` observations a rank is persistently slow when its median
forward time is more than `slow_factor` x the median of the others' and it
was the slowest in most of them; one slow step (a page fault, a descheduled
process) is not enough. The decision is the same on every rank: they decide
from the same gathered numbers.

What follows is the policy's (tessel.train.fault.guard acts on it):
- warn: the evidence is logged;
- rebalance: the work is shared again in proportion to each rank's measured
  speed (its work over its forward time): its dp share, or its pipeline
  stage's blocks (tessel.planner.hetero.rebalanced), and the run continues
  from a checkpoint in that layout;
- evict: a checkpoint, then the run continues without that rank's node (every
  rank that shares it: `evicted_with`), re-planned for the ranks left
  (tessel.elastic.adaptive.run_layouts).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from tessel.comm.topology import nodes_from_nproc, resolve_nodes
from tessel.config import Config, FaultConfig

IDLE_BACKWARD = 2.0  # backward takes this many times a forward (the planner's and the emulator's assumption)


@dataclass
class SlowRank:
    """The evidence that names a slow rank."""
    rank: int
    steps: tuple[int, int]  # the window it rests on
    forward_s: list[float]  # each rank's median forward seconds per step over the window
    idle_s: list[float]  # each rank's median idle seconds per step: the step less its compute
    ratio: float  # its forward over the median of the others'

    def line(self) -> str:
        others = statistics.median(t for r, t in enumerate(self.forward_s) if r != self.rank)
        ranks = ", ".join(f"{r}: {f:.3f}/{i:.3f}" for r, (f, i) in enumerate(zip(self.forward_s, self.idle_s)))
        return (f"[tessel slow] steps {self.steps[0]}-{self.steps[1]}: rank {self.rank} is persistently slow: "
                f"forward {self.forward_s[self.rank]:.3f} s/step vs {others:.3f} s for the others "
                f"({self.ratio:.1f}x); per rank forward/idle s: {ranks}")


@dataclass
class Relayout(Exception):
    """Continue from `checkpoint` in `cfg`'s layout, without the `evict` ranks (raised by the trainer after
    the step that decided it, on every rank)."""
    cfg: Config
    checkpoint: str
    evict: list[int] = field(default_factory=list)
    reason: str = ""

    def __str__(self) -> str:
        return self.reason


class SlowRanks:
    """The window of evidence, and the decision it supports."""

    def __init__(self, f: FaultConfig):
        self.window, self.factor = f.slow_window, f.slow_factor
        self.seen: list[tuple[int, list[float], float]] = []  # (step, forward per rank, step seconds)

    def observe(self, step: int, forward: list[float], step_s: float) -> SlowRank | None:
        """One observation (per-step forward seconds of every rank, this step's seconds); the slow rank
        once the window names one (then the window starts again)."""
        if len(forward) < 2:
            return None
        self.seen = (self.seen + [(step, forward, step_s)])[-self.window:]
        if len(self.seen) < self.window:
            return None
        n = len(forward)
        med = [statistics.median(obs[1][r] for obs in self.seen) for r in range(n)]
        idle = [statistics.median(max(0.0, s - (1 + IDLE_BACKWARD) * f[r]) for _, f, s in self.seen)
                for r in range(n)]
        slow = max(range(n), key=lambda r: med[r])
        others = statistics.median(med[r] for r in range(n) if r != slow)
        ratio = med[slow] / others if others > 0 else 1.0
        slowest_often = sum(max(range(n), key=lambda r: f[r]) == slow for _, f, _ in self.seen) * 2 > self.window
        if ratio <= self.factor or not slowest_often:
            return None
        found = SlowRank(slow, (self.seen[0][0], self.seen[-1][0]), med, idle, ratio)
        self.seen = []
        return found


def world_nodes(cfg: Config, world: int) -> list[list[int]]:
    """The ranks of each node: the topology file, runtime.nproc_per_node, else torchrun's node size."""
    r = cfg.runtime
    try:
        return resolve_nodes(world, r.topology, r.nproc_per_node)
    except ValueError:  # a topology file, or torchrun's node size, of the world before an earlier eviction
        per = r.nproc_per_node
        return nodes_from_nproc(world, per) if per and world % per == 0 else [list(range(world))]


def evicted_with(cfg: Config, world: int, slow: int) -> tuple[list[int], str]:
    """The ranks that leave when `slow` is evicted, and a line that says which and why.

    Its whole node (world_nodes): a node is what a scheduler replaces and what tensor parallelism's groups
    sit inside, and the node's other ranks left behind would spread the world unevenly over the nodes.
    Where that node is the whole job, the rank leaves alone: evicting a slow device should not stop the
    job, and the node's other devices are healthy.
    """
    nodes = world_nodes(cfg, world)
    if len(nodes) == 1:
        return [slow], f"rank {slow} alone (its node is the whole job; the node's other {world - 1} ranks stay)"
    k, node = next((k, n) for k, n in enumerate(nodes) if slow in n)
    return list(node), f"node {k} (ranks {', '.join(map(str, node))}, with slow rank {slow})"
