"""Pipeline schedules as data: one list of actions per pipeline rank, built before anything runs.

A schedule is the order in which each rank runs forward (F) and backward (B)
passes of micro-batches on its model chunks, with the point-to-point traffic
spelled out: RF/SF receive/send an activation, RB/SB a gradient. The runner
executes the lists as written; tests and the bubble table read them without
any process (see `simulate`).

- GPipe (Huang et al. 2019): every forward, then every backward. m micro-batches
  are in flight at the peak.
- 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-
  Parallel DNN Training"): rank r runs p-1-r warm-up forwards, then alternates
  one forward and one backward, then drains; at most p - r in flight.
- Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters", sec. 2.2): each rank holds v chunks; virtual
  stage s = chunk * p + rank; the bubble shrinks by v.

Every schedule built here passes `simulate(..., strict=True)`: it needs no
buffering of sends, so it cannot deadlock under NCCL's fused P2P groups.
"""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B")
SENDS = ("SF", "SB")
RECVS = ("RF", "RB")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B (compute) | SF, SB (send) | RF, RB (receive)
    mb: int  # micro-batch
    chunk: int = 0  # model chunk on this rank (virtual stage = chunk * p + rank)
    peer: int | None = None  # pipeline rank at the other end of a send / receive

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}{self.mb}.{self.chunk}{peer}"


Schedule = list[list[Action]]  # schedule[rank] = that rank's actions in order


@dataclass(frozen=True)
class Placement:
    """Where one pipeline rank's chunks sit: chunk c is virtual stage c * p + rank of p * v.

    With v = 1 a rank holds one stage; with v > 1 its chunks are spread round
    the pipeline (interleaved 1F1B, Narayanan et al. 2021, sec. 2.2)."""
    p: int  # pipeline ranks
    v: int  # chunks per rank (virtual stages)
    rank: int

    def stage(self, chunk: int) -> int:
        return chunk * self.p + self.rank

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.p * self.v - 1


# ---- compute orders ----------------------------------------------------------
def gpipe_order(p: int, m: int, rank: int) -> list[Action]:
    return [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]


def one_f_one_b_order(p: int, m: int, rank: int) -> list[Action]:
    warmup = min(p - 1 - rank, m)
    order = [Action("F", i) for i in range(warmup)]
    for i in range(m - warmup):  # steady state: one forward, one backward
        order += [Action("F", warmup + i), Action("B", i)]
    order += [Action("B", i) for i in range(m - warmup, m)]
    return order


def interleaved_order(p: int, m: int, rank: int, v: int) -> list[Action]:
    """Megatron's order: groups of p micro-batches sweep chunk 0..v-1 forward, v-1..0 backward."""
    if m % p:
        raise ValueError(f"interleaved 1F1B needs micro-batches ({m}) divisible by pp ({p})")
    total = m * v

    def step(k: int, kind: str) -> Action:
        c = (k // p) % v
        mb = (k // (p * v)) * p + k % p
        return Action(kind, mb, c if kind == "F" else v - 1 - c)

    # deeper warm-up than 1F1B: a rank must run (v-1)*p extra forwards before
    # its first backward comes back through all the chunks
    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    order = [step(k, "F") for k in range(warmup)]
    for i in range(total - warmup):
        order += [step(warmup + i, "F"), step(i, "B")]
    order += [step(i, "B") for i in range(total - warmup, total)]
    return order


# ---- communication -------------------------------------------------------------
def add_communication(orders: list[list[Action]], v: int = 1) -> Schedule:
    """Insert receives right before the compute that needs them and sends right after.

    Consecutive communication actions form one batch (one batch_isend_irecv):
    the sends of the last compute go out with the receives of the next, the
    pairing Megatron uses (send_forward_recv_backward and friends).
    """
    p = len(orders)
    last = p * v - 1
    schedule: Schedule = []
    for rank, order in enumerate(orders):
        out: list[Action] = []
        for a in order:
            s = a.chunk * p + rank  # virtual stage
            if a.kind == "F":
                if s > 0:
                    out.append(Action("RF", a.mb, a.chunk, (rank - 1) % p))
                out.append(a)
                if s < last:
                    out.append(Action("SF", a.mb, a.chunk, (rank + 1) % p))
            else:
                if s < last:
                    out.append(Action("RB", a.mb, a.chunk, (rank + 1) % p))
                out.append(a)
                if s > 0:
                    out.append(Action("SB", a.mb, a.chunk, (rank - 1) % p))
        schedule.append(out)
    return schedule


def build_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    """The full per-rank action lists of schedule `name` for p ranks, m micro-batches, v chunks."""
    if name == "gpipe":
        orders = [gpipe_order(p, m, r) for r in range(p)]
    elif name == "1f1b":
        orders = [one_f_one_b_order(p, m, r) for r in range(p)]
    elif name == "interleaved":
        if p == 1:
            # one rank holds every chunk: each micro-batch goes down the chunks and back
            orders = [[Action("F", i, c) for i in range(m) for c in range(v)]
                      + [Action("B", i, c) for i in range(m) for c in reversed(range(v))]]
        else:
            orders = [interleaved_order(p, m, r, v) for r in range(p)]
    else:
        raise ValueError(f"unknown schedule {name!r}; known: gpipe, 1f1b, interleaved")
    if name != "interleaved":
        v = 1
    schedule = add_communication(orders, v)
    if name == "interleaved" and m > p:
        schedule = [fuse_steady_state(actions) for actions in schedule]
    return schedule


def fuse_steady_state(actions: list[Action]) -> list[Action]:
    """Megatron's steady-state pairing: F(k), B(j), then one batch {SF(k), SB(j), RF(k+1), RB(j+1)}.

    Where a forward is directly followed by a backward, the communication
    between them moves out: its receive (the backward's gradient) joins the
    batch before the forward, its send (the forward's output) the batch after
    the backward. Neighbouring ranks then post matching batches, so the
    interleaved schedule needs no buffering of sends (it survives simulate's
    strict mode, as NCCL's fused groups require); without this pairing a rank
    can wait in a batch whose send its neighbour will only receive later.
    """
    items = [list(i) for i in batches(actions)]
    i = 0
    while i + 2 < len(items):
        f, mid, b = items[i], items[i + 1], items[i + 2]
        if f and mid and b and f[0].kind == "F" and mid[0].kind not in COMPUTE and b[0].kind == "B":
            sends = [a for a in mid if a.kind in SENDS]
            recvs = [a for a in mid if a.kind in RECVS]
            items[i + 1] = []
            if i + 3 < len(items) and items[i + 3] and items[i + 3][0].kind not in COMPUTE:
                items[i + 3] = sends + items[i + 3]
            else:
                items.insert(i + 3, sends)
            if i > 0 and items[i - 1] and items[i - 1][0].kind not in COMPUTE:
                items[i - 1] = items[i - 1] + recvs
            else:
                items.insert(i, recvs)
                i += 1
        i += 1
    return [a for item in items for a in item]


def batches(actions: list[Action]) -> list[list[Action]]:
    """Split a rank's list into items: a compute action alone, or a run of communication."""
    items: list[list[Action]] = []
    for a in actions:
        if a.kind in COMPUTE or not items or items[-1][0].kind in COMPUTE:
            items.append([a])
        else:
            items[-1].append(a)
    return items


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch-chunks forwarded but not yet backwarded at once on one rank."""
    live = peak = 0
    for a in actions:
        live += {"F": 1, "B": -1}.get(a.kind, 0)
        peak = max(peak, live)
    return peak


# ---- simulation ------------------------------------------------------------------
class ScheduleError(RuntimeError):
    pass


@dataclass
class _Op:
    action: Action
    rank: int
    stage: int  # virtual stage of the action
    posted: float
    done: float | None = None


def simulate(schedule: Schedule, v: int = 1, t_fwd: float = 1.0, t_bwd: float = 2.0,
             strict: bool = True, cost=None) -> list[list[tuple[Action, float, float]]]:
    """Run the lists on a model of the machine; returns each rank's (action, start, end) computes.

    Messages on a link (src -> dst) match in the order they are posted, as NCCL
    and gloo match them (NCCL has no tags), so a send must meet the receive of
    the same micro-batch and chunk or ScheduleError is raised. strict=True lets
    a rank continue past a batch only when all of its sends and receives have
    met their partners (NCCL's fused group); strict=False waits on receives
    only. A state in which no rank can move is a deadlock (ScheduleError).
    cost(rank, action) -> seconds overrides t_fwd/t_bwd (e.g. measured times);
    messages take no time.
    """
    p = len(schedule)
    items = [batches(acts) for acts in schedule]
    pc, clock = [0] * p, [0.0] * p
    sends: dict[tuple[int, int], list[_Op]] = {}
    recvs: dict[tuple[int, int], list[_Op]] = {}
    posted: list[list[_Op] | None] = [None] * p
    have: list[set] = [set() for _ in range(p)]  # (kind, mb, chunk) data present on a rank
    done_f: list[set] = [set() for _ in range(p)]
    timeline: list[list] = [[] for _ in range(p)]
    while True:
        moved = False
        for r in range(p):
            if pc[r] == len(items[r]):
                continue
            item = items[r][pc[r]]
            if item[0].kind in COMPUTE:
                a = item[0]
                _check_inputs(a, r, p, v, have[r], done_f[r])
                dt = cost(r, a) if cost else (t_fwd if a.kind == "F" else t_bwd)
                timeline[r].append((a, clock[r], clock[r] + dt))
                clock[r] += dt
                (done_f[r].add((a.mb, a.chunk)) if a.kind == "F" else None)
                pc[r] += 1
                moved = True
                continue
            if posted[r] is None:
                posted[r] = [_post(a, r, a.chunk * p + r, clock[r], sends, recvs) for a in item]
                moved = True
            ops = posted[r] if strict else [o for o in posted[r] if o.action.kind in RECVS]
            if all(o.done is not None for o in ops):
                clock[r] = max([clock[r]] + [o.done for o in ops])
                for o in posted[r]:
                    if o.action.kind in RECVS:
                        have[r].add((o.action.kind, o.action.mb, o.action.chunk))
                posted[r] = None
                pc[r] += 1
                moved = True
        if all(pc[r] == len(items[r]) for r in range(p)):
            _check_drained(sends, recvs)
            return timeline
        if not moved:
            stuck = {r: items[r][pc[r]] for r in range(p) if pc[r] < len(items[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}")


def _post(a: Action, rank: int, stage: int, t: float, sends: dict, recvs: dict) -> _Op:
    op = _Op(a, rank, stage, t)
    if a.kind in SENDS:
        link, mine, other = (rank, a.peer), sends, recvs
    else:
        link, mine, other = (a.peer, rank), recvs, sends
    mine.setdefault(link, []).append(op)
    k = len(mine[link]) - 1
    if k < len(other.get(link, [])):
        _match(other[link][k], op)
    return op


def _match(x: _Op, y: _Op) -> None:
    send, recv = (x, y) if x.action.kind in SENDS else (y, x)
    want = {"SF": "RF", "SB": "RB"}[send.action.kind]
    step = 1 if send.action.kind == "SF" else -1  # activations go down the stages, gradients up
    if recv.action.kind != want or recv.action.mb != send.action.mb or recv.stage != send.stage + step:
        raise ScheduleError(f"message mismatch on link {send.rank}->{recv.rank}: "
                            f"{send.action} meets {recv.action}")
    send.done = recv.done = max(send.posted, recv.posted)


def _check_inputs(a: Action, r: int, p: int, v: int, have: set, done_f: set) -> None:
    s, last = a.chunk * p + r, p * v - 1
    if a.kind == "F" and s > 0 and ("RF", a.mb, a.chunk) not in have:
        raise ScheduleError(f"rank {r}: {a} runs before its activation arrived")
    if a.kind == "B":
        if (a.mb, a.chunk) not in done_f:
            raise ScheduleError(f"rank {r}: {a} runs before its forward")
        if s < last and ("RB", a.mb, a.chunk) not in have:
            raise ScheduleError(f"rank {r}: {a} runs before its gradient arrived")


def _check_drained(sends: dict, recvs: dict) -> None:
    for link in set(sends) | set(recvs):
        if len(sends.get(link, [])) != len(recvs.get(link, [])):
            raise ScheduleError(f"link {link}: {len(sends.get(link, []))} sends, "
                                f"{len(recvs.get(link, []))} receives")


def bubble_fraction(timeline: list[list[tuple[Action, float, float]]]) -> float:
    """Idle share of the makespan, averaged over ranks."""
    end = max(e for events in timeline for _, _, e in events)
    busy = [sum(e - s for _, s, e in events) for events in timeline]
    return 1 - sum(busy) / (len(timeline) * end)
