"""The planner's view of the pipeline schedules: the runtime's own action lists, read, not re-written.

`tessel.parallel.pipeline.schedules` builds the per-rank Action lists the
runner executes (GPipe, Huang et al. 2019; 1F1B, Narayanan et al. 2019/2021;
interleaved 1F1B, Narayanan et al. 2021). That module is torch-free, so the
planner imports it: the cost model's activation counts, the analytic bubble and
the simulator (planner/simulate.py) all read the same lists the runner runs,
and a change to a schedule changes the plan with it.
tests/planner/test_schedule_identity.py holds the two together.
"""

from __future__ import annotations

from functools import lru_cache

from tessel.parallel.pipeline.schedules import (COMPUTE, Action, Schedule, build_schedule, max_in_flight,
                                                simulate)
from tessel.parallel.pipeline.schedules import bubble_fraction as idle_fraction


@lru_cache(maxsize=256)
def pipeline_schedule(schedule: str, p: int, m: int, v: int = 1) -> Schedule:
    """The runtime's action lists for (schedule, pp, micro-batches, virtual stages).

    Cached: a search asks for the same few schedules many times. The lists are
    shared, so callers read them and never change them."""
    return build_schedule(schedule, p, m, v)


def stage_ops(schedule: str, p: int, m: int, stage: int, v: int = 1) -> list[Action]:
    """The forwards and backwards pipeline rank `stage` runs, in the runtime's order."""
    return [a for a in pipeline_schedule(schedule, p, m, v)[stage] if a.kind in COMPUTE]


def peak_in_flight(ops: list[Action]) -> int:
    """Most chunk-forwards whose activations are held at once (forward done, backward not)."""
    return max_in_flight(ops)


@lru_cache(maxsize=256)
def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the runtime's schedule on uniform stages with free messages.

    Each chunk's forward takes 1/v and its backward 2/v of a stage's time, the
    lists are replayed by the runtime's simulator, and the idle share is read
    off the replay. On such stages it equals the closed forms, GPipe and 1F1B
    (p-1)/(m+p-1) and interleaved (p-1)/(v*m+p-1) (tests/planner/test_cost.py).
    """
    v = v if schedule == "interleaved" else 1
    timeline = simulate(pipeline_schedule(schedule, p, m, v), v, t_fwd=1 / v, t_bwd=2 / v, strict=False)
    return idle_fraction(timeline)
