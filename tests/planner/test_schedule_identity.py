"""The planner's schedules are the runtime's: the same Action lists, replayed by the simulator.

The runner executes `build_schedule(name, pp, m, v)[rank]`; the planner asks
`pipeline_schedule` for the same lists (one object per key) and the simulator
replays their compute actions in their order. A schedule changed in
tessel/parallel/pipeline/schedules.py therefore changes the plan with it.
"""

import itertools
import subprocess
import sys

import pytest

from tessel.parallel.pipeline import schedules as runtime
from tessel.parallel.pipeline.async_schedules import build_async
from tessel.planner import schedule as planner
from tessel.planner.simulate import PipelineSim
from tests.helpers import ROOT

CASES = [(name, p, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         for p, m in itertools.product((1, 2, 3, 4), (1, 2, 4, 8)) if name != "interleaved" or m % p == 0]


def _label(a: runtime.Action, v: int) -> str:
    return f"{a.kind}{a.mb}" + (f".{a.chunk}" if v > 1 else "")


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_the_planner_and_the_simulator_hold_the_runtimes_action_lists(name, p, m, v):
    lists = planner.pipeline_schedule(name, p, m, v)
    assert lists == runtime.build_schedule(name, p, m, v)
    assert planner.pipeline_schedule(name, p, m, v) is lists  # one object per (schedule, p, m, v)
    sim = PipelineSim([[(1.0 / v, 2.0 / v)] * v for _ in range(p)], name, m, v)
    assert sim.schedule is lists
    sim.run()
    for rank in range(p):  # each rank ran the runtime's computes, in the runtime's order
        ran = [e.name for e in sim.events if e.device == rank and e.row == "compute"]
        assert ran == [_label(a, v) for a in lists[rank] if a.kind in runtime.COMPUTE]
        assert planner.stage_ops(name, p, m, rank, v) == [a for a in lists[rank] if a.kind in runtime.COMPUTE]


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_the_analytic_bubble_is_the_runtime_schedules_idle_share(name, p, m, v):
    timeline = runtime.simulate(runtime.build_schedule(name, p, m, v), v, t_fwd=1 / v, t_bwd=2 / v, strict=False)
    assert planner.bubble_fraction(name, p, m, v) == pytest.approx(runtime.bubble_fraction(timeline))


def test_the_planner_imports_no_torch_distributed():
    code = ("import sys; import tessel.planner.schedule, tessel.planner.simulate, tessel.planner.search; "
            "assert 'torch.distributed' not in sys.modules, 'the planner pulled in torch.distributed'")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


NEW_CASES = [(name, p, m) for name in ("zb-h1", "zb-h2", "zbv", "2bw", "pipedream")
             for p, m in itertools.product((2, 3, 4), (4, 8)) if m >= p]


@pytest.mark.parametrize("name,p,m", NEW_CASES)
def test_the_planner_replays_the_zero_bubble_and_asynchronous_lists(name, p, m):
    """The split backward's W and ZBV's V in the simulator; an asynchronous pipeline's steady step (the
    runtime's step k >= 1, tessel.parallel.pipeline.async_schedules) with the last step's work done."""
    v = 2 if name == "zbv" else 1
    lists = planner.pipeline_schedule(name, p, m, v)
    plan = build_async(p, m) if name in ("2bw", "pipedream") else None
    assert lists == (plan.steps[-1] if plan else runtime.build_schedule(name, p, m, v))
    sim = PipelineSim([[(1.0 / v, 2.0 / v)] * v for _ in range(p)], name, m, v)
    sim.run()
    for rank in range(p):
        ran = [e.name for e in sim.events if e.device == rank and e.row == "compute"]
        assert ran == [_label(a, v) for a in lists[rank] if a.kind in runtime.COMPUTE]
    carried = [set(c) for c in plan.carried[-1]] if plan else None
    timeline = runtime.simulate(lists, v, t_fwd=1 / v, t_bwd=2 / v, strict=False, vshape=name == "zbv",
                                carried=carried)
    assert planner.bubble_fraction(name, p, m, v) == pytest.approx(runtime.bubble_fraction(timeline))
