"""Pipeline schedules as data: one list of actions per pipeline rank, built before anything runs.

A schedule is the order in which each rank runs forward (F) and backward (B)
passes of micro-batches on its model chunks, with the point-to-point traffic
spelled out: RF/SF receive/send an activation, RB/SB a gradient. Zero-bubble
schedules split the backward: B is then the input's gradient only and W the
weights' (split_backward.py). The runner executes the lists as written; tests
and the bubble table read them without any process (see `simulate`).

- GPipe (Huang et al. 2019): every forward, then every backward. m micro-batches
  are in flight at the peak.
- 1F1B, PipeDream-Flush (Narayanan et al. 2021, "Memory-Efficient Pipeline-
  Parallel DNN Training"): rank r runs p-1-r warm-up forwards, then alternates
  one forward and one backward, then drains; at most p - r in flight.
- Interleaved 1F1B (Narayanan et al. 2021, "Efficient Large-Scale Language
  Model Training on GPU Clusters", sec. 2.2): each rank holds v chunks; virtual
  stage s = chunk * p + rank; the bubble shrinks by v.
- ZB-H1, ZB-H2 and ZBV (Qi et al. 2023, "Zero Bubble Pipeline Parallelism"):
  W moved into 1F1B's idle time; ZBV's two chunks sit in a V, rank r holding
  stages r and 2p-1-r (zero_bubble.py has their orders and bubbles).

Every schedule built here passes `simulate(..., strict=True)`: it needs no
buffering of sends, so it cannot deadlock under NCCL's fused P2P groups.
`simulate(..., strict=False)` is gloo's behaviour, tessel's CPU runtime: sends
never wait, a compute waits for the receive it needs.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.parallel.pipeline.action import COMPUTE, RECVS, SENDS, Action
from tessel.parallel.pipeline.zero_bubble import zb_h1_order, zb_h2_orders, zbv_orders

__all__ = ["COMPUTE", "RECVS", "SENDS", "Action"]  # defined in action.py, read from here too

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zb-h2", "zbv")
# B and W apart (zero_bubble.py); the asynchronous pipelines too (async_schedules.py)
SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zbv", "pipedream", "2bw")


def splits_backward(name: str) -> bool:
    """Whether the schedule runs a micro-batch's backward as B (input gradient) and W (weights)."""
    return name in SPLIT_BACKWARD


def is_vshape(name: str) -> bool:
    """Whether rank r's chunks are stages r and 2p-1-r (ZBV) rather than r, r+p, ... (interleaved)."""
    return name == "zbv"


Schedule = list[list[Action]]  # schedule[rank] = that rank's actions in order


@dataclass(frozen=True)
class Placement:
    """Where one pipeline rank's chunks sit: chunk c is virtual stage c * p + rank of p * v.

    With v = 1 a rank holds one stage; with v > 1 its chunks are spread round
    the pipeline (interleaved 1F1B, Narayanan et al. 2021, sec. 2.2). In a V
    (ZBV, Qi et al. 2023, sec. 6) rank r holds stages r and 2p-1-r."""
    p: int  # pipeline ranks
    v: int  # chunks per rank (virtual stages)
    rank: int
    vshape: bool = False

    def stage(self, chunk: int) -> int:
        return stage_of(self.p, self.rank, chunk, self.vshape)

    def is_first(self, chunk: int) -> bool:
        return self.stage(chunk) == 0

    def is_last(self, chunk: int) -> bool:
        return self.stage(chunk) == self.p * self.v - 1


def stage_of(p: int, rank: int, chunk: int, vshape: bool = False) -> int:
    """The virtual stage of a rank's chunk."""
    if vshape:
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def owner_of(p: int, stage: int, vshape: bool = False) -> tuple[int, int]:
    """(rank, chunk) holding a virtual stage."""
    if vshape:
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


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
def add_communication(orders: list[list[Action]], v: int = 1, vshape: bool = False) -> Schedule:
    """Insert receives right before the compute that needs them and sends right after.

    Consecutive communication actions form one batch (one batch_isend_irecv):
    the sends of the last compute go out with the receives of the next, the
    pairing Megatron uses (send_forward_recv_backward and friends). Neighbouring
    stages on one rank (the turn of ZBV's V) exchange nothing: the executor
    hands the tensor over in place. W sends nothing.
    """
    p = len(orders)
    last = p * v - 1
    schedule: Schedule = []
    for rank, order in enumerate(orders):
        out: list[Action] = []
        for a in order:
            s = stage_of(p, rank, a.chunk, vshape)
            if a.kind == "W":
                out.append(a)
                continue
            before, after = (s - 1, s + 1) if a.kind == "F" else (s + 1, s - 1)
            recv, send = ("RF", "SF") if a.kind == "F" else ("RB", "SB")
            if 0 <= before <= last and owner_of(p, before, vshape)[0] != rank:
                out.append(Action(recv, a.mb, a.chunk, owner_of(p, before, vshape)[0]))
            out.append(a)
            if 0 <= after <= last and owner_of(p, after, vshape)[0] != rank:
                out.append(Action(send, a.mb, a.chunk, owner_of(p, after, vshape)[0]))
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
    elif name == "zb-h1":
        orders = [zb_h1_order(p, m, r) for r in range(p)]
    elif name == "zb-h2":
        orders = zb_h2_orders(p, m)
    elif name == "zbv":
        orders = zbv_orders(p, m)
    else:
        raise ValueError(f"unknown schedule {name!r}; known: {', '.join(SCHEDULES)}")
    v = {"interleaved": v, "zbv": 2}.get(name, 1)
    schedule = add_communication(orders, v, is_vshape(name))
    if is_vshape(name):
        schedule = pair_for_rendezvous(align_receives(schedule), v, vshape=True)
    if name == "interleaved" and m > p:
        schedule = [fuse_steady_state(actions) for actions in schedule]
    return schedule


def align_receives(schedule: Schedule) -> Schedule:
    """Each rank posts the receives of a link in the order its neighbour sends on it.

    Messages on a link match in posting order (NCCL has no tags). In a V both
    directions of a link carry two streams (rank r sends chunk 0's activations
    and chunk 1's gradients to r+1), which the two ranks' compute orders
    interleave differently; a receive moves earlier, never later, than the
    compute that needs it, until the link's receives follow the sends.
    """
    p = len(schedule)
    sent: dict[tuple[int, int], list[tuple[str, int]]] = {}  # (src, dst) -> (kind, mb) in send order
    for r, actions in enumerate(schedule):
        for a in actions:
            if a.kind in SENDS:
                sent.setdefault((r, a.peer), []).append((a.kind[1], a.mb))
    out: Schedule = []
    for r, actions in enumerate(schedule):
        rest = [a for a in actions if a.kind not in RECVS]
        position = {a: i for i, a in enumerate(rest) if a.kind in COMPUTE}
        needed_at = {(a.kind[1], a.mb, a.peer): position[Action(a.kind[1], a.mb, a.chunk)] for a in actions
                     if a.kind in RECVS}
        recv_of = {(a.kind[1], a.mb, a.peer): a for a in actions if a.kind in RECVS}
        before: dict[int, list[Action]] = {}
        for src in range(p):
            deadline = len(rest)
            for kind, mb in reversed(sent.get((src, r), [])):
                deadline = min(deadline, needed_at[(kind, mb, src)])
                before.setdefault(deadline, []).insert(0, recv_of[(kind, mb, src)])
        # a receive goes right before its deadline's compute, after that compute's sends batch
        merged: list[Action] = []
        for i, a in enumerate(rest):
            if i in before and a.kind in COMPUTE:
                merged += before[i]
            merged.append(a)
        out.append(merged)
    return out


def pair_for_rendezvous(schedule: Schedule, v: int, vshape: bool = False, carried: list[set] | None = None) -> Schedule:
    """The schedule with receives pulled into the batches of sends that would otherwise wait on each other.

    Under rendezvous semantics (NCCL's fused groups: simulate(strict=True)) a
    send waits for its receive to be posted. Two neighbours each waiting in a
    batch that sends to the other deadlock; each then posts its next receive
    from the other in that batch, as Megatron pairs send_forward with
    recv_backward. A receive only moves earlier, and the next one of its link,
    so messages still match in order. One replay finds and fixes them all.
    """
    _, items = _replay(schedule, v, 1.0, 2.0, True, None, vshape, carried, pair=True)
    return [[a for item in its for a in item] for its in items]


def _pull_next_receive(items: list[list[Action]], i: int, peer: int) -> Action | None:
    """Move the first receive from `peer` after item i into item i (a batch of communication)."""
    for later in items[i + 1:]:
        for a in later:
            if a.kind in RECVS and a.peer == peer:
                later.remove(a)
                items[i].append(a)
                return a
    return None


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
    """Most micro-batch-chunks forwarded but not yet backwarded at once on one rank (with the backward
    split, until their W: the graph is kept from B to W, tessel.parallel.pipeline.split_backward)."""
    release = "W" if any(a.kind == "W" for a in actions) else "B"
    live = peak = 0
    for a in actions:
        live += 1 if a.kind == "F" else -1 if a.kind == release else 0
        peak = max(peak, live)
    return peak


# ---- simulation ------------------------------------------------------------------
class ScheduleError(RuntimeError):
    def __init__(self, message: str, stuck: dict[int, int] | None = None):
        super().__init__(message)
        self.stuck = stuck or {}  # a deadlock: rank -> the index (in batches()) of the item it waits at


@dataclass
class _Op:
    action: Action
    rank: int
    stage: int  # virtual stage of the action
    posted: float
    done: float | None = None


def simulate(schedule: Schedule, v: int = 1, t_fwd: float = 1.0, t_bwd: float = 2.0,
             strict: bool = True, cost=None, vshape: bool = False,
             carried: list[set] | None = None) -> list[list[tuple[Action, float, float]]]:
    """Run the lists on a model of the machine; returns each rank's (action, start, end) computes.

    Messages on a link (src -> dst) match in the order they are posted, as NCCL
    and gloo match them (NCCL has no tags), so a send must meet the receive of
    the same micro-batch and chunk or ScheduleError is raised. strict=True lets
    a rank continue past a batch only when all of its sends and receives have
    met their partners (NCCL's fused group); strict=False waits on receives
    only. A state in which no rank can move is a deadlock (ScheduleError).
    cost(rank, action) -> seconds overrides t_fwd/t_bwd (e.g. measured times);
    where the backward is split (W actions), B and W take t_bwd / 2 each.
    Messages take no time. vshape: the lists place chunks in a V (ZBV).
    carried[r]: the (kind, mb, chunk) computes rank r ran in an earlier step
    (an asynchronous pipeline's step continues the micro-batches of the last).
    """
    return _replay(schedule, v, t_fwd, t_bwd, strict, cost, vshape, carried)[0]


def _replay(schedule: Schedule, v: int, t_fwd: float, t_bwd: float, strict: bool, cost, vshape: bool,
            carried: list[set] | None, pair: bool = False) -> tuple[list[list], list[list[list[Action]]]]:
    """simulate's replay; with pair, a deadlock of two ranks sending to each other is fixed in place
    (pair_for_rendezvous). Returns the timeline and the (fixed) batches."""
    p = len(schedule)
    split = any(a.kind == "W" for acts in schedule for a in acts)
    duration = {"F": t_fwd, "B": t_bwd / 2 if split else t_bwd, "W": t_bwd / 2}
    items = [batches(acts) for acts in schedule]
    pc, clock = [0] * p, [0.0] * p
    sends: dict[tuple[int, int], list[_Op]] = {}
    recvs: dict[tuple[int, int], list[_Op]] = {}
    posted: list[list[_Op] | None] = [None] * p
    incoming: list[dict] = [{} for _ in range(p)]  # (RF | RB, mb, chunk) -> its posted receive
    done: list[set] = [set(c) for c in carried] if carried else [set() for _ in range(p)]  # computes finished
    timeline: list[list] = [[] for _ in range(p)]
    while True:
        moved = False
        for r in range(p):
            if pc[r] == len(items[r]):
                continue
            item = items[r][pc[r]]
            if not item:  # a batch whose receives moved earlier (pair)
                pc[r] += 1
                moved = True
                continue
            if item[0].kind in COMPUTE:
                a = item[0]
                recv = _check_inputs(a, r, p, v, vshape, incoming[r], done[r])
                if recv is not None and recv.done is None:
                    continue  # gloo: the compute waits for its message, the rank for the compute
                start = max(clock[r], recv.done) if recv is not None else clock[r]
                dt = cost(r, a) if cost else duration[a.kind]
                timeline[r].append((a, start, start + dt))
                clock[r] = start + dt
                done[r].add((a.kind, a.mb, a.chunk))
                pc[r] += 1
                moved = True
                continue
            if posted[r] is None:
                posted[r] = [_post(a, r, stage_of(p, r, a.chunk, vshape), clock[r], sends, recvs) for a in item]
                incoming[r].update({(o.action.kind, o.action.mb, o.action.chunk): o for o in posted[r]
                                    if o.action.kind in RECVS})
                moved = True
            # strict (NCCL's fused group): the batch ends when every message in it has met its partner;
            # otherwise (gloo) posting is all, and a compute waits for the receive it needs
            if not strict or all(o.done is not None for o in posted[r]):
                if strict:
                    clock[r] = max([clock[r]] + [o.done for o in posted[r]])
                posted[r] = None
                pc[r] += 1
                moved = True
        if all(pc[r] == len(items[r]) for r in range(p)):
            _check_drained(sends, recvs)
            return timeline, items
        if not moved and pair:
            moved = _pair_stuck(items, pc, posted, incoming, clock, sends, recvs, vshape)
        if not moved:
            stuck = {r: items[r][pc[r]] for r in range(p) if pc[r] < len(items[r])}
            raise ScheduleError(f"deadlock: ranks wait at {stuck}",
                                {r: pc[r] for r in range(p) if pc[r] < len(items[r])})


def _pair_stuck(items, pc, posted, incoming, clock, sends, recvs, vshape: bool) -> bool:
    """Each rank stuck in a batch that sends to a neighbour stuck sending to it posts, in that batch, its
    next receive from that neighbour; False if there is no such pair (a real deadlock)."""
    p = len(items)
    waiting = {r: {o.action.peer for o in posted[r] if o.action.kind in SENDS and o.done is None}
               for r in range(p) if pc[r] < len(items[r]) and posted[r] is not None}
    moved = False
    for r, peers in waiting.items():
        for q in peers:
            if r not in waiting.get(q, ()):
                continue
            a = _pull_next_receive(items[r], pc[r], q)
            if a is not None:
                op = _post(a, r, stage_of(p, r, a.chunk, vshape), clock[r], sends, recvs)
                posted[r].append(op)
                incoming[r][(a.kind, a.mb, a.chunk)] = op
                moved = True
    return moved


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


def _check_inputs(a: Action, r: int, p: int, v: int, vshape: bool, incoming: dict, done: set) -> _Op | None:
    """ScheduleError unless a's inputs are computed or posted for; the receive a waits on, if any."""
    s, last = stage_of(p, r, a.chunk, vshape), p * v - 1
    if a.kind == "W":
        if ("B", a.mb, a.chunk) not in done:
            raise ScheduleError(f"rank {r}: {a} runs before its B")
        return None
    if a.kind == "B" and ("F", a.mb, a.chunk) not in done:
        raise ScheduleError(f"rank {r}: {a} runs before its forward")
    src = s - 1 if a.kind == "F" else s + 1
    if not 0 <= src <= last:
        return None  # the first stage's forward, the last stage's backward
    owner, chunk = owner_of(p, src, vshape)
    if owner == r:  # the V's turn: the neighbouring stage is this rank's other chunk
        if (a.kind, a.mb, chunk) not in done:
            raise ScheduleError(f"rank {r}: {a} runs before {a.kind}{a.mb} of its other chunk")
        return None
    recv = incoming.get(("RF" if a.kind == "F" else "RB", a.mb, a.chunk))
    if recv is None:
        what = "activation" if a.kind == "F" else "gradient"
        raise ScheduleError(f"rank {r}: {a} runs before its {what} arrived")
    return recv


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
