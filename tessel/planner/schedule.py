"""The planner's view of the pipeline schedules: the runtime's own action lists, read, not re-written.

`tessel.parallel.pipeline.schedules` builds the per-rank Action lists the
runner executes (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019/2021;
interleaved 1F1B, Narayanan et al. 2021; ZB-H1, ZB-H2, ZBV, Qi et al. 2023),
`async_schedules` those of the asynchronous pipelines (PipeDream, 2BW: a
steady step, which continues the last). Both are torch-free, so the planner
imports them: the cost model's activation counts, the analytic bubble and
the simulator (planner/simulate.py) all read the same lists the runner runs,
and a change to a schedule changes the plan with it.
tests/planner/test_schedule_identity.py holds the two together.
"""

from __future__ import annotations

from functools import lru_cache

from tessel.parallel.pipeline.async_schedules import build_async, is_async
from tessel.parallel.pipeline.schedules import (COMPUTE, SPLIT_BACKWARD, Action, Schedule, build_schedule, is_vshape,
                                                max_in_flight, simulate)
from tessel.parallel.pipeline.schedules import bubble_fraction as idle_fraction

CHUNKS = {"interleaved": None, "zbv": 2}  # chunks a rank holds: interleaved's v is chosen, zbv's is 2


def chunks_per_rank(schedule: str, v: int) -> int:
    """v for interleaved, 2 for ZBV's V, 1 otherwise."""
    return v if schedule == "interleaved" else CHUNKS.get(schedule) or 1


def splits_backward(schedule: str) -> bool:
    """B (the input's gradient) and W (the weights') run apart (tessel.parallel.pipeline.split_backward)."""
    return schedule in SPLIT_BACKWARD


@lru_cache(maxsize=256)
def pipeline_schedule(schedule: str, p: int, m: int, v: int = 1) -> Schedule:
    """The runtime's action lists for (schedule, pp, micro-batches, virtual stages).

    Cached: a search asks for the same few schedules many times. The lists are
    shared, so callers read them and never change them. An asynchronous
    pipeline's are its steady step's (see `carried`)."""
    if is_async(schedule):
        return build_async(p, m).steps[-1]
    return build_schedule(schedule, p, m, v)


@lru_cache(maxsize=256)
def carried(schedule: str, p: int, m: int) -> tuple[frozenset, ...] | None:
    """An asynchronous pipeline's steady step continues the last: the computes each rank ran before it."""
    return build_async(p, m).carried[-1] if is_async(schedule) else None


def stage_ops(schedule: str, p: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """The forwards and backwards pipeline rank `stage` runs, in the runtime's order."""
    return [a for a in pipeline_schedule(schedule, p, m, v)[stage] if a.kind in COMPUTE]


def peak_in_flight(ops: list[Action]) -> int:
    """Most chunk-forwards whose activations are held at once (forward done, backward not)."""
    return max_in_flight(ops)


@lru_cache(maxsize=256)
def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the runtime's schedule on uniform stages with free messages.

    Each chunk's forward takes 1/v and its backward 2/v of a stage's time (B
    and W half each where the backward is split), the lists are replayed by the
    runtime's simulator, and the idle share is read off the replay. On such
    stages it equals the closed forms, GPipe and 1F1B (p-1)/(m+p-1),
    interleaved (p-1)/(v*m+p-1), ZB-H1 and ZB-H2 (p-1)/(3m+p-1), ZBV
    (p-1)/(6m+p-1), an asynchronous pipeline's steady step 0
    (tests/planner/test_cost.py).
    """
    v = chunks_per_rank(schedule, v)
    before = carried(schedule, p, m)
    timeline = simulate(pipeline_schedule(schedule, p, m, v), v, t_fwd=1 / v, t_bwd=2 / v, strict=False,
                        vshape=is_vshape(schedule), carried=[set(c) for c in before] if before else None)
    return idle_fraction(timeline)


@lru_cache(maxsize=1024)
def held_micro_batches(schedule: str, p: int, m: int, stage: int, v: int = 1) -> tuple[int, int]:
    """(activations, captured gradients): the most micro-batch-chunks rank `stage` holds at once from F to
    the end of its backward (W where the backward is split), and from B to W (each keeps the gradients its B
    captured for W, tessel.parallel.pipeline.split_backward). An asynchronous pipeline's step starts with
    the previous step's micro-batches still held."""
    return max(live for live, _ in _held_over_time(schedule, p, m, stage, v)), \
        max(between for _, between in _held_over_time(schedule, p, m, stage, v))


def held_bytes(schedule: str, p: int, m: int, stage: int, v: int, activation: float, captured: float) -> float:
    """The most bytes rank `stage` holds for backward at once: each micro-batch-chunk from F to the end of
    its backward holds `activation` bytes, each from B to W `captured` more (the two peaks need not meet)."""
    return max(live * activation + between * captured
               for live, between in _held_over_time(schedule, p, m, stage, v))


@lru_cache(maxsize=1024)
def _held_over_time(schedule: str, p: int, m: int, stage: int, v: int) -> tuple[tuple[int, int], ...]:
    """After each compute of the rank (and at the step's start): (held from F, held from B to W)."""
    release = "W" if splits_backward(schedule) else "B"
    before = carried(schedule, p, m)
    done = before[stage] if before else frozenset()
    began = {(mb, c) for k, mb, c in done if k == "F"} - {(mb, c) for k, mb, c in done if k == release}
    captured = {(mb, c) for k, mb, c in done if k == "B"} - {(mb, c) for k, mb, c in done if k == "W"}
    live, between = len(began), len(captured) if splits_backward(schedule) else 0
    out = [(live, between)]
    for a in stage_ops(schedule, p, m, stage, chunks_per_rank(schedule, v)):
        live += 1 if a.kind == "F" else -1 if a.kind == release else 0
        if splits_backward(schedule):
            between += {"B": 1, "W": -1}.get(a.kind, 0)
        out.append((live, between))
    return tuple(out)


# ---- what the new schedules change in the cost model (tessel.planner.pricing.pipeline calls these) -----
NEW_SCHEDULES = ("zb-h1", "zb-h2", "zbv", "pipedream", "2bw")  # priced here; older ones by pricing/pipeline.py


def device_chunks(schedule: str, p: int, v: int, stage: int) -> list[int]:
    """The model chunks (virtual stages) pipeline rank `stage` holds: s, s+p, ... or in ZBV's V s, 2p-1-s."""
    if is_vshape(schedule):
        return [stage, 2 * p - 1 - stage]
    return [stage + j * p for j in range(v)]


def flush_time(schedule: str, stage_busy: list[float], stage_fwd: list[float], m: int, v: int, p2p: float) -> float:
    """One step's pipeline under a split backward or an asynchronous schedule, on stages busy stage_busy[s]
    per micro-batch (forward stage_fwd[s] of it), each message p2p seconds.

    The busiest stage paces the steady state (m of its micro-batches), as for 1F1B. What is left is the wait
    for the first input, which W's cannot fill (Qi et al. 2023 with B = W): ZB-H1 and ZB-H2 the other
    stages' forwards, ZBV half of them (each chunk is half a stage), an asynchronous pipeline's steady step
    nothing (the last step's micro-batches fill it, async_schedules.py); plus a message per stage boundary
    on the way down. The search re-prices its leaders with the simulator, which replays the lists."""
    p = len(stage_busy)
    top = max(stage_busy)
    if p == 1 or is_async(schedule):
        return m * top
    fill = sum(stage_fwd) - stage_fwd[stage_busy.index(top)]
    if is_vshape(schedule):
        fill /= 2
    return m * top + fill + (p * chunks_per_rank(schedule, v) - 1) * p2p


def captured_gradient_bytes(d_model: int, kv_dim: int, ffn_dim: int, tokens: int, tp: int, act_bytes: int) -> float:
    """Bytes of the gradients B captures for W in one reference-GPT block (split_backward.py): the gradient
    flowing into each matmul's node, as wide as that node's output: wq (d), wk and wv (kv each), wo (d), the
    SwiGLU's gate and up (ffn each) and down (d); tp splits them. The two norms' scales are vectors whose
    gradients B computes itself (split_plan.py): 2 d numbers, not counted."""
    return tokens * (3 * d_model + 2 * kv_dim + 2 * ffn_dim) / tp * act_bytes


def stashed_versions(schedule: str, held: int) -> int:
    """Copies of a stage's weights an asynchronous pipeline keeps besides the weights themselves
    (weight_versions.py): 2BW two (W_k and W_{k-1}), PipeDream one per micro-batch held from F to W."""
    if schedule == "2bw":
        return 2
    return held if schedule == "pipedream" else 0
