"""Asynchronous pipelines as action lists: 1F1B that never flushes, cut into the trainer's steps.

PipeDream (Narayanan et al. 2019, "PipeDream: Generalized Pipeline Parallelism
for DNN Training") and PipeDream-2BW (Narayanan et al. 2021, "Memory-Efficient
Pipeline-Parallel DNN Training") keep 1F1B's steady state running from one
batch into the next: the next batch's forwards fill the time the last batch's
drain would leave idle. They differ only in which weights a micro-batch sees
(tessel.parallel.pipeline.weight_versions); the order of work is the same and
is built here, torch-free, so the planner prices the same lists.

The order is one unbroken stream, run at unit times (F = B = W = 1, the
backward split as in zero-bubble schedules, so every action ends on the same
grid): each rank runs a B whose gradient has arrived, else an F while fewer
than p - r micro-batches are held between F and W (1F1B's memory), else its
oldest W. The stream is cut where rank 0 starts a batch's first forward: step
k holds every action that starts between rank 0's F of micro-batch k*m and
that of (k+1)*m. Rank 0 forwards exactly step k's batch; later ranks finish
the previous batch's last micro-batches at the start of step k, while the
front of the pipeline is already on batch k. Micro-batch indices in a step's
lists are relative to it: -m..-1 are the previous batch's.

The steps are synchronous at their ends (the trainer's update is a
collective), so a message whose producer ran before the cut and whose consumer
runs after it is sent at the start of the consumer's step, from what the
producer kept: no message crosses a step boundary. Cut on the grid, step k's
work per rank is exactly m F, m B and m W, and every rank is busy from the
step's start to its end: no fill and no drain once the stream is steady. The
first step is the stream's start (the fill); the lists repeat from the step at
which the stream is steady.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from tessel.parallel.pipeline.action import Action
from tessel.parallel.pipeline.schedules import Schedule, pair_for_rendezvous

ASYNC_SCHEDULES = ("pipedream", "2bw")
STREAM_BATCHES = 6  # batches run through the unit-time stream to reach its steady state


def is_async(name: str) -> bool:
    return name in ASYNC_SCHEDULES


@dataclass(frozen=True)
class AsyncPlan:
    """The lists of every step of an asynchronous pipeline (the last repeats), with what each step inherits."""
    p: int
    m: int
    steps: tuple[Schedule, ...]  # steps[k][rank]; step k >= len(steps) runs steps[-1]
    carried: tuple[tuple[frozenset, ...], ...]  # carried[k][rank]: (kind, mb, 0) computed before step k
    w_before: tuple[int, ...]  # W's rank 0 ran before each of the stream's forwards on rank 0 (vertical sync)

    def lists(self, step: int) -> Schedule:
        return self.steps[min(step, len(self.steps) - 1)]

    def carried_into(self, step: int) -> tuple[frozenset, ...]:
        return self.carried[min(step, len(self.carried) - 1)]

    def rank0_updates_before_forward(self, g: int) -> int:
        """How many W's (PipeDream: updates) rank 0 ran before its forward of global micro-batch g: the
        weight version vertical sync gives micro-batch g on every stage."""
        known = len(self.w_before)
        if g < known:
            return self.w_before[g]
        cycles = (g - known) // self.m + 1  # steady: each batch adds m W's on rank 0
        return self.w_before[g - cycles * self.m] + cycles * self.m


def build_async(p: int, m: int) -> AsyncPlan:
    """The asynchronous 1F1B's steps for p ranks and m micro-batches a step (m >= p)."""
    if m < p:
        raise ValueError(f"an asynchronous pipeline needs at least as many micro-batches ({m}) as ranks ({p})")
    stream = _unit_stream(p, m, STREAM_BATCHES * m)
    starts = [t for t, kind, g in stream[0] if kind == "F" and g % m == 0]  # rank 0 starts each batch
    calls = [_cut(stream, p, m, k, starts[k], starts[k + 1]) for k in range(len(starts) - 1)]
    carried = [_carried(calls, k, m) for k in range(len(calls))]
    steady = next(k for k in range(1, len(calls) - 1) if calls[k] == calls[k + 1] and carried[k] == carried[k + 1])
    steps = tuple(pair_for_rendezvous(calls[k], 1, carried=[set(c) for c in carried[k]]) for k in range(steady + 1))
    w_before, w = [], 0
    for _, kind, g in stream[0]:
        if kind == "W":
            w += 1
        elif kind == "F":
            w_before.append(w)
    return AsyncPlan(p, m, steps, tuple(carried[:steady + 1]), tuple(w_before[: (len(starts) - 2) * m]))


def _unit_stream(p: int, m: int, n: int) -> list[list[tuple[int, str, int]]]:
    """Each rank's (start, kind, global micro-batch) for n micro-batches at unit times, no flush."""
    done: dict[tuple[str, int, int], int] = {}  # (kind, g, rank) -> end time
    next_f, next_b = [0] * p, [0] * p
    pending_w: list[deque] = [deque() for _ in range(p)]
    held = [0] * p
    stream: list[list] = [[] for _ in range(p)]
    t = 0
    while any(len(s) < 3 * n for s in stream):
        for r in range(p):
            g_b, g_f = next_b[r], next_f[r]
            if g_b < n and done.get(("F", g_b, r), t + 1) <= t and (r == p - 1 or done.get(("B", g_b, r + 1), t + 1) <= t):
                kind, g = "B", g_b
                next_b[r] += 1
                pending_w[r].append(g)
            elif g_f < n and held[r] < p - r and (r == 0 or done.get(("F", g_f, r - 1), t + 1) <= t):
                kind, g = "F", g_f
                next_f[r] += 1
                held[r] += 1
            elif pending_w[r]:
                kind, g = "W", pending_w[r].popleft()
                held[r] -= 1
            else:
                continue
            done[(kind, g, r)] = t + 1
            stream[r].append((t, kind, g))
        t += 1
    return stream


def _cut(stream, p: int, m: int, k: int, start: int, end: int) -> Schedule:
    """Step k's lists: its computes, each receive right before its consumer, each send right after its
    producer when both are in the step, else at the start of the consumer's step (kept until then)."""
    when = {(kind, g, r): t for r in range(p) for t, kind, g in stream[r]}  # (kind, g, rank) -> start time

    def in_step(kind: str, g: int, r: int) -> bool:
        return start <= when.get((kind, g, r), -1) < end

    lists: Schedule = []
    for r in range(p):
        out: list[Action] = []
        for t, kind, g in stream[r]:
            if not start <= t < end:
                continue
            mb = g - k * m
            if kind == "F" and r > 0:
                out.append(Action("RF", mb, 0, r - 1))
            if kind == "B" and r < p - 1:
                out.append(Action("RB", mb, 0, r + 1))
            out.append(Action(kind, mb))
            if kind == "F" and r < p - 1 and in_step("F", g, r + 1):
                out.append(Action("SF", mb, 0, r + 1))
            if kind == "B" and r > 0 and in_step("B", g, r - 1):
                out.append(Action("SB", mb, 0, r - 1))
        # what this rank computed before the step and a neighbour consumes in it, in the consumer's order
        deferred = [Action("SF", g - k * m, 0, r + 1) for t, kind, g in (stream[r + 1] if r < p - 1 else ())
                    if kind == "F" and start <= t < end and when[("F", g, r)] < start]
        deferred += [Action("SB", g - k * m, 0, r - 1) for t, kind, g in (stream[r - 1] if r > 0 else ())
                     if kind == "B" and start <= t < end and when[("B", g, r)] < start]
        lists.append(deferred + out)
    return lists


def _carried(calls: list[Schedule], k: int, m: int) -> tuple[frozenset, ...]:
    """Per rank, the computes of steps before k that step k's micro-batches still build on (relative to k)."""
    p = len(calls[0])
    out = []
    for r in range(p):
        seen = set()
        for j in range(max(0, k - 2), k):
            seen |= {(a.kind, a.mb - (k - j) * m, 0) for a in calls[j][r] if a.kind in ("F", "B", "W")}
        out.append(frozenset(x for x in seen if x[1] >= -m))
    return tuple(out)
