"""Pipeline schedules as data: order, matching messages, no deadlock, bounded in-flight work, bubble;
the zero-bubble schedules (ZB-H1, ZB-H2, ZBV) among them."""

import itertools

import pytest

from tessel.parallel.pipeline.schedules import (Action, ScheduleError, add_communication, bubble_fraction,
                                                build_schedule, interleaved_order, is_vshape, max_in_flight, simulate,
                                                stage_of)

CASES = [(name, p, m, v) for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 3))
         for p, m in itertools.product((1, 2, 3, 4), (1, 2, 4, 8, 12)) if name != "interleaved" or m % p == 0]


def _v(name, v):
    return v if name == "interleaved" else 1


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_micro_batch_forwarded_once_then_backwarded_once(name, p, m, v):
    for rank, actions in enumerate(build_schedule(name, p, m, v)):
        computes = [a for a in actions if a.kind in ("F", "B")]
        for chunk in range(v):
            fwd = [a.mb for a in computes if a.kind == "F" and a.chunk == chunk]
            bwd = [a.mb for a in computes if a.kind == "B" and a.chunk == chunk]
            assert sorted(fwd) == list(range(m)) and sorted(bwd) == list(range(m))
        position = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(computes)}
        for (kind, mb, chunk), i in position.items():
            if kind == "B":
                assert position[("F", mb, chunk)] < i, f"rank {rank}: B{mb}.{chunk} before its forward"


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_sends_match_receives_and_execution_never_deadlocks(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    # every send has exactly one receive of the same micro-batch on the neighbouring virtual stage
    sends = {(r, a.peer, a.kind[1], a.mb, a.chunk * p + r) for r, acts in enumerate(schedule)
             for a in acts if a.kind in ("SF", "SB")}
    recvs = {(a.peer, r, a.kind[1], a.mb, a.chunk * p + r + (-1 if a.kind == "RF" else 1))
             for r, acts in enumerate(schedule) for a in acts if a.kind in ("RF", "RB")}
    assert sends == recvs
    assert len(sends) == sum(a.kind in ("SF", "SB") for acts in schedule for a in acts)
    # simulated execution: FIFO matching per link (as NCCL), inputs present before each compute
    timeline = simulate(schedule, _v(name, v), strict=False)
    assert sum(len(t) for t in timeline) == 2 * m * p * _v(name, v)


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_every_schedule_survives_rendezvous_semantics(name, p, m, v):
    """With fused send+recv batches that finish only when every partner is there (NCCL groups)."""
    simulate(build_schedule(name, p, m, v), _v(name, v), strict=True)


def test_interleaved_without_steady_state_pairing_needs_buffered_sends():
    # why fuse_steady_state exists: the plain placement deadlocks under rendezvous semantics
    orders = [interleaved_order(2, 4, r, 2) for r in range(2)]
    plain = add_communication(orders, v=2)
    simulate(plain, 2, strict=False)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(plain, 2, strict=True)


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 8), (4, 12)])
def test_in_flight_bounds(p, m):
    gpipe = [max_in_flight(a) for a in build_schedule("gpipe", p, m)]
    one_f = [max_in_flight(a) for a in build_schedule("1f1b", p, m)]
    assert gpipe == [m] * p
    assert max(one_f) <= p and one_f == [min(p - r, m) for r in range(p)]  # p - rank on rank r


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_bubble_matches_theory_and_interleaving_shrinks_it(p, m):
    theory = (p - 1) / (m + p - 1)
    for name in ("gpipe", "1f1b"):
        assert bubble_fraction(simulate(build_schedule(name, p, m))) == pytest.approx(theory)
    for v in (2, 4):
        # a chunk is 1/v of a stage, so each forward/backward costs 1/v as much
        timeline = simulate(build_schedule("interleaved", p, m, v), v, t_fwd=1 / v, t_bwd=2 / v, strict=False)
        assert bubble_fraction(timeline) == pytest.approx((p - 1) / (v * m + p - 1))


def test_interleaved_walks_all_virtual_stages_in_order():
    p, m, v = 2, 4, 2
    timeline = simulate(build_schedule("interleaved", p, m, v), v, strict=False)
    # micro-batch 0's forward visits virtual stages 0, 1, 2, 3 in increasing time
    starts = {(a.chunk * p + r): s for r, events in enumerate(timeline) for a, s, _ in events
              if a.kind == "F" and a.mb == 0}
    assert [starts[s] for s in range(p * v)] == sorted(starts[s] for s in range(p * v))
    assert starts[0] < starts[1] < starts[2] < starts[3]


def test_simulator_catches_a_deadlock_and_a_mismatch():
    # both ranks receive before they send: a cycle
    bad = [[Action("RB", 0, 0, 1), Action("F", 0), Action("SF", 0, 0, 1), Action("B", 0)],
           [Action("RF", 0, 0, 0), Action("F", 0), Action("B", 0), Action("SB", 0, 0, 0)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(bad)
    # receives posted in another order than the sends: message 0 would land in micro-batch 1
    orders = [[Action("F", 0), Action("F", 1), Action("B", 0), Action("B", 1)],
              [Action("F", 1), Action("F", 0), Action("B", 1), Action("B", 0)]]
    with pytest.raises(ScheduleError, match="mismatch"):
        simulate(add_communication(orders), strict=False)


# ---- zero-bubble schedules (Qi et al. 2023): the backward split into B and W ----------------------
ZB_CASES = [(name, p, m) for name in ("zb-h1", "zb-h2", "zbv") for p, m in itertools.product((1, 2, 3, 4), (1, 2, 4, 8))
            if name != "zbv" or m >= p]


def _zb(name, p, m):
    v = 2 if name == "zbv" else 1
    return build_schedule(name, p, m, v), v


@pytest.mark.parametrize("name,p,m", ZB_CASES)
def test_zero_bubble_runs_f_b_w_once_each_in_order_and_survives_rendezvous(name, p, m):
    schedule, v = _zb(name, p, m)
    for rank, actions in enumerate(schedule):
        computes = [(a.kind, a.mb, a.chunk) for a in actions if a.kind in ("F", "B", "W")]
        assert sorted(computes) == sorted((k, i, c) for k in "FBW" for i in range(m) for c in range(v))
        for kind, mb, chunk in computes:  # F before B before W
            if kind != "F":
                before = "F" if kind == "B" else "B"
                assert computes.index((before, mb, chunk)) < computes.index((kind, mb, chunk))
    # every message meets its partner in order, with and without buffered sends (NCCL's and gloo's rules)
    for strict in (True, False):
        timeline = simulate(schedule, v, strict=strict, vshape=is_vshape(name))
        assert sum(len(t) for t in timeline) == 3 * m * p * v


def test_zbv_places_two_stages_per_rank_in_a_v():
    p = 4
    assert [[stage_of(p, r, c, vshape=True) for c in (0, 1)] for r in range(p)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    schedule, _ = _zb("zbv", p, 8)
    # the turn of the V (stage 3 -> 4 on rank 3) and the loss (stage 7 on rank 0) exchange no message
    assert not any(a.kind in ("SF", "RF") and a.peer == 3 for a in schedule[3])
    assert not any(a.kind == "SF" and a.chunk == 1 for a in schedule[0])


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (4, 4), (4, 8), (4, 16)])
def test_zero_bubble_bubbles_and_held_micro_batches(p, m):
    """Unit times F = B = W = 1 (t_bwd = 2 is B + W): the paper's bubbles within one step's flush."""
    def bubble(name):
        schedule, v = _zb(name, p, m)
        # a ZBV chunk is half a stage: its F, B and W take half as long
        return bubble_fraction(simulate(schedule, v, t_fwd=1 / v, t_bwd=2 / v, strict=False, vshape=is_vshape(name)))

    one_f = (p - 1) / (m + p - 1)
    assert bubble("zb-h1") == pytest.approx((p - 1) / (3 * m + p - 1))  # (p-1) F of idle per rank, not 3(p-1)
    assert bubble("zb-h1") <= one_f / 2
    assert bubble("zb-h2") <= bubble("zb-h1") + 1e-9
    assert bubble("zbv") == pytest.approx((p - 1) / (6 * m + p - 1))  # the last rank waits (p-1)/2 F
    # micro-batches held from F to W: ZB-H1 at most 1F1B's peak (p), ZB-H2 up to 2p-1, ZBV 2p half stages
    assert max(max_in_flight(a) for a in _zb("zb-h1", p, m)[0]) == min(p, m) == \
        max(max_in_flight(a) for a in build_schedule("1f1b", p, m))
    assert max(max_in_flight(a) for a in _zb("zb-h2", p, m)[0]) <= 2 * p - 1
    assert max(max_in_flight(a) for a in _zb("zbv", p, m)[0]) <= 2 * p


@pytest.mark.parametrize("p,m", [(2, 4), (2, 8), (3, 6), (4, 8)])
@pytest.mark.parametrize("t_b,t_w", [(1.25, 0.85), (1.5, 0.7)])
def test_zbv_turn_rank_sends_a_gradient_before_it_hands_itself_one(p, m, t_b, t_w):
    """With B longer than F, as on this CPU, the turn of the V (rank p-1) never idles after its first B: where
    both its B's are ready it first runs stage p-1's, which rank p-2 waits for, then stage p's, which only
    feeds its own stage p-1 (deepest-first idled it 0.4 F at B = 1.25 F, 0.8 F at 1.5 F)."""
    schedule, v = _zb("zbv", p, m)
    timeline = simulate(schedule, v, cost=lambda r, a: {"F": 1.0, "B": t_b, "W": t_w}.get(a.kind, 0.0),
                        strict=False, vshape=True)
    turn = sorted(timeline[p - 1], key=lambda x: x[1])
    first_b = next(i for i, (a, _, _) in enumerate(turn) if a.kind == "B")
    for (_, _, end), (a, start, _) in zip(turn[first_b:], turn[first_b + 1:]):
        assert start == pytest.approx(end), a
