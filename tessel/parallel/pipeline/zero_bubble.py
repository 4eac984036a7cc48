"""Zero-bubble schedules' compute orders (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"): the
backward split into B (the input's gradient, on the critical path) and W (the weights' gradients,
free to move), W placed where 1F1B would idle. Torch-free, like schedules.py, which adds the messages.

Times below are in units of one F, taking B = W = F (the paper's handcrafted case).

- ZB-H1 (sec. 3.1): 1F1B's warm-up and steady state with the backward split, and rank r's first r
  W's deferred to the cool-down, where 1F1B's ranks idle. At most p micro-batches are held between
  their F and their W on any rank: 1F1B's peak (rank 0's). Bubble (p-1) F per rank against 1F1B's
  3(p-1) F: (p-1)/(3m+p-1) of the step.
- ZB-H2 (sec. 3.1): more forwards in the warm-up (up to 2p-1 held), so no rank idles before its first
  B; in the steady state each rank runs whatever is ready, B first (it unblocks the rank before),
  then F, then W. Within one step whose end every rank waits for (tessel's optimizer step), the last
  rank still waits (p-1) F for its first input, so with B = W = F its bubble equals ZB-H1's; where
  W is shorter than B the extra forwards hide more of it. (The paper's zero needs the next step's
  warm-up to start before this one's optimizer step, its sec. 4, which tessel's synchronous update
  does not do.)
- ZBV (sec. 6): two chunks per rank in a V: rank r holds virtual stages r and 2p-1-r, so the first
  and last stage share rank 0 and the turn of the V sits on rank p-1 with no message. Forwards of
  chunk 0 fill the warm-up, then chunk 1's forward/B/W triples, then alternating chunk 0 and chunk 1
  F-B-W; the cool-down runs whatever B is ready (the deeper stage first), else the oldest W. At most
  2p half-stage micro-batches are held (1F1B's p); the last rank's wait for its first input halves,
  (p-1)/2 F, so the bubble is (p-1)/(6m+p-1).
"""

from __future__ import annotations

from collections import deque

from tessel.parallel.pipeline.action import Action


def zb_h1_order(p: int, m: int, rank: int) -> list[Action]:
    """1F1B with B and W apart; rank r's first r W's wait for the cool-down."""
    warmup = min(p - 1 - rank, m)
    order = [Action("F", i) for i in range(warmup)]
    w = 0
    for i in range(m - warmup):
        order += [Action("F", warmup + i), Action("B", i)]
        if i >= rank:
            order.append(Action("W", w))
            w += 1
    for i in range(m - warmup, m):
        order += [Action("B", i), Action("W", w)]
        w += 1
    return order + [Action("W", i) for i in range(w, m)]


def zb_h2_orders(p: int, m: int) -> list[list[Action]]:
    """Greedy at unit times, up to 2p-1 micro-batches held between F and W on every rank."""
    return UnitTimeBuilder(p, m, [[r] for r in range(p)], limit=2 * p - 1).build()


def zbv_orders(p: int, m: int) -> list[list[Action]]:
    """The V: rank r holds stages r (chunk 0) and 2p-1-r (chunk 1). Needs m >= p."""
    if m < p:
        raise ValueError(f"zbv needs at least as many micro-batches ({m}) as pipeline ranks ({p})")
    stages = [[r, 2 * p - 1 - r] for r in range(p)]
    return UnitTimeBuilder(p, m, stages, limit=2 * p, prefixes=[_zbv_prefix(p, m, r) for r in range(p)]).build()


def _zbv_prefix(p: int, m: int, rank: int) -> list[Action]:
    """ZBV's warm-up and steady state on one rank; the cool-down is left to the builder."""
    order: list[Action] = []
    fwd, bwd = [0, 0], [0, 0]

    def forward(c: int) -> None:
        if fwd[c] < m:
            order.append(Action("F", fwd[c], c))
            fwd[c] += 1

    def backward(c: int) -> None:
        order.extend([Action("B", bwd[c], c), Action("W", bwd[c], c)])
        bwd[c] += 1

    for _ in range(2 * (p - rank) - 1):  # chunk 0 until the first forward comes back down the V
        forward(0)
    for _ in range(rank):
        forward(1)
        forward(0)
    for _ in range(p - rank):
        forward(1)
        backward(1)
    while fwd[0] < m or fwd[1] < fwd[0]:
        forward(0)
        backward(0)
        forward(1)
        backward(1)
    return order


class UnitTimeBuilder:
    """Compute orders found by running the pipeline at unit times (F = B = W = 1).

    Each rank first runs its prefix as written (waiting for inputs), then, at
    every time step, the first of: a B whose gradient has arrived (one whose
    gradient goes to another rank first, then the deepest stage: it unblocks
    the longest chain), an F whose input has arrived while fewer than `limit`
    micro-batch-chunks are held between F and W (the deepest stage first), the
    oldest pending W. Each stage runs its F's and its B's in micro-batch order,
    so messages on a link match in order.

    Sending first matters at the turn of ZBV's V (rank p-1), whose two B's are
    often ready at once in the cool-down: stage p's gradient only feeds its own
    stage p-1, stage p-1's is what rank p-2 waits for. At unit times either
    order ends the step at once; where B takes longer than F (this CPU: B about
    1.25 F, W 0.85 F), deepest-first left the turn rank idle for its own
    gradient while rank p-2 waited for the other (docs/pipelines.md).
    """

    def __init__(self, p: int, m: int, stages: list[list[int]], limit: int,
                 prefixes: list[list[Action]] | None = None):
        self.p, self.m, self.stages, self.limit = p, m, stages, limit
        self.last = sum(len(s) for s in stages) - 1
        self.prefix = [deque(pre) for pre in (prefixes or [[] for _ in range(p)])]
        self.done: dict[tuple[str, int, int], int] = {}  # (kind, mb, stage) -> its end time
        self.next_f = [0] * (self.last + 1)
        self.next_b = [0] * (self.last + 1)
        self.pending_w: list[deque] = [deque() for _ in range(p)]
        self.held = [0] * p
        self.orders: list[list[Action]] = [[] for _ in range(p)]

    def build(self) -> list[list[Action]]:
        total, t = 3 * self.m * (self.last + 1), 0
        while sum(map(len, self.orders)) < total:
            for r in range(self.p):
                a = self._prefix_next(r, t) if self.prefix[r] else self._choose(r, t)
                if a is not None:
                    self._run(r, a, t)
            t += 1
            if t > 10 * total:
                raise RuntimeError("unit-time schedule builder made no progress")  # a bug, not an input
        return self.orders

    def _ready(self, r: int, a: Action, t: int) -> bool:
        s = self.stages[r][a.chunk]
        if a.kind == "F":
            need = [("F", a.mb, s - 1)] if s > 0 else []
        elif a.kind == "B":
            need = [("F", a.mb, s)] + ([("B", a.mb, s + 1)] if s < self.last else [])
        else:
            need = [("B", a.mb, s)]
        return all(self.done.get(k, t + 1) <= t for k in need)

    def _prefix_next(self, r: int, t: int) -> Action | None:
        a = self.prefix[r][0]
        if not self._ready(r, a, t):
            return None
        self.prefix[r].popleft()
        if a.kind == "F":
            self.next_f[self.stages[r][a.chunk]] += 1
        elif a.kind == "B":
            self.next_b[self.stages[r][a.chunk]] += 1
            if not any(x.kind == "W" and x.mb == a.mb and x.chunk == a.chunk for x in self.prefix[r]):
                self.pending_w[r].append(Action("W", a.mb, a.chunk))
        elif Action("W", a.mb, a.chunk) in self.pending_w[r]:
            self.pending_w[r].remove(Action("W", a.mb, a.chunk))
        return a

    def _choose(self, r: int, t: int) -> Action | None:
        deepest_first = sorted(range(len(self.stages[r])), key=lambda c: -self.stages[r][c])
        for c in sorted(deepest_first, key=lambda c: not self._sends_gradient_away(r, c)):  # stable: then deepest
            a = Action("B", self.next_b[self.stages[r][c]], c)
            if a.mb < self.m and self._ready(r, a, t):
                self.next_b[self.stages[r][c]] += 1
                self.pending_w[r].append(Action("W", a.mb, c))
                return a
        if self.held[r] < self.limit:
            for c in deepest_first:
                a = Action("F", self.next_f[self.stages[r][c]], c)
                if a.mb < self.m and self._ready(r, a, t):
                    self.next_f[self.stages[r][c]] += 1
                    return a
        return self.pending_w[r].popleft() if self.pending_w[r] else None

    def _sends_gradient_away(self, r: int, c: int) -> bool:
        """Whether the B of rank r's chunk c sends its input's gradient to another rank."""
        s = self.stages[r][c]
        return s > 0 and s - 1 not in self.stages[r]

    def _run(self, r: int, a: Action, t: int) -> None:
        self.done[(a.kind, a.mb, self.stages[r][a.chunk])] = t + 1
        self.held[r] += {"F": 1, "W": -1}.get(a.kind, 0)
        self.orders[r].append(a)
