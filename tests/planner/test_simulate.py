"""The simulator against the analytic pipeline formulas, link sharing, and its outputs."""

import json

import pytest

from tessel.planner.cluster import Link
from tessel.planner.schedule import bubble_fraction
from tessel.planner.simulate import PipelineSim, _Transfer, simulate_pipeline, write_png, write_trace


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 4, 8, 1), ("1f1b", 4, 8, 1), ("gpipe", 3, 5, 1),
                                            ("1f1b", 8, 3, 1), ("1f1b", 2, 1, 1), ("interleaved", 4, 8, 2)])
def test_uniform_stages_match_the_bubble_formula(schedule, p, m, v):
    # uniform stages, backward twice the forward, free communication: the makespan is
    # (v*m + p - 1) chunk times, so the bubble is (p-1)/(v*m+p-1)
    f, b = 1.0 / v, 2.0 / v
    res = simulate_pipeline([[(f, b)] * v for _ in range(p)], schedule, m, v)
    assert res.step_s == pytest.approx((v * m + p - 1) * (f + b))
    assert res.bubble == pytest.approx(bubble_fraction(schedule, p, m, v))


def test_transfers_share_a_link():
    # one 100-byte transfer on a 100 B/s link takes 1 s; two at once take 2 s each
    sim = PipelineSim([[(0.0, 0.0)]], "1f1b", 1)
    sim.link_bw[("x",)] = 100.0
    done = []
    for name in ("a", "b"):
        sim.add_transfer(_Transfer(name, 0, None, (("x",),), 100.0, 0.0, lambda n=name: done.append((n, sim.now))))
    sim.run()
    assert [t for _, t in done] == pytest.approx([2.0, 2.0])
    sim = PipelineSim([[(0.0, 0.0)]], "1f1b", 1)
    sim.link_bw[("x",)] = 100.0
    sim.add_transfer(_Transfer("a", 0, None, (("x",),), 100.0, 0.5, lambda: done.append(("c", sim.now))))
    sim.run()
    assert done[-1][1] == pytest.approx(1.5)  # 0.5 s latency + 1 s on the wire


def test_p2p_transfers_delay_the_pipeline():
    # 2 stages, 1 micro-batch: F0, send (1 s), F1, B1, send (1 s), B0
    res = simulate_pipeline([[(1.0, 2.0)], [(1.0, 2.0)]], "1f1b", 1, p2p_bytes=10.0, pp_link=Link(10.0, 0.0))
    assert res.step_s == pytest.approx(1 + 1 + 1 + 2 + 1 + 2)


def test_writes_trace_and_timeline(tmp_path):
    res = simulate_pipeline([[(1.0, 2.0)]] * 4, "1f1b", 8)
    trace = json.loads(write_trace(res, tmp_path / "t.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(spans) == 4 * 8 * 2 and {e["pid"] for e in spans} == {0, 1, 2, 3}
    png = write_png(res, tmp_path / "t.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
