"""The planner's profile of the reference model on this machine (2 real ranks, a tiny GPT)."""

from tessel.calibrate.profile import profile_model
from tessel.config import ModelConfig


def test_profile_measures_compute_per_tp_shape_and_tp_collectives_in_a_step(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path))
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16)
    cal = profile_model(cfg, 16, world=2, micro_batches=[1, 4])
    assert sorted(cal.tp_points) == [1, 2]
    for points in cal.tp_points.values():
        assert [t for t, _ in points] == [16, 64] and all(f > 0 for _, f in points)
    # each tp=2 micro-batch issues ~12 gloo all-reduces the compute-only model skips; even on
    # loopback each costs tens of microseconds, far above the noise of a median of 5 rounds
    assert [t for t, _ in cal.tp_comm[2]] == [16, 64]
    assert all(s > 0 for _, s in cal.tp_comm[2])
    assert cal.opt_s_per_param > 0 and cal.step_overhead_s > 0
    # cached: the second call reads the file instead of spawning ranks
    assert list(tmp_path.rglob("profile-*.json"))
    assert profile_model(cfg, 16, world=2, micro_batches=[1, 4]).tp_comm == cal.tp_comm


def _workspace():
    from tessel.calibrate.profile import collective_workspace
    return collective_workspace(4 * 2**20)


def test_collective_workspace_sees_gloo_copies():
    from tessel.spawn import spawn
    for w in spawn(_workspace, 2):
        assert sorted(w) == ["all_gather", "all_reduce", "reduce_scatter"]
        assert all(0 <= v < 10 for v in w.values())
        # gloo's reduce-scatter reduces a copy of its whole input, so the peak shows at least that
        # much (measured 1.8-1.9x at 2 ranks, 1.0-1.35x at 4); its all-gather stages a copy of at
        # least the gathered half (0.58-1.09x at 2 ranks)
        assert w["reduce_scatter"] > 0.9 and w["all_gather"] > 0.4


def _handoff():
    import torch.distributed as dist

    from tessel.calibrate.profile import PROBE_BYTES, _p2p_under_load
    out = _p2p_under_load(dist.get_world_size())
    return out, PROBE_BYTES


def test_handoff_probe_gives_every_rank_the_same_points_per_size():
    from tessel.spawn import spawn
    results = spawn(_handoff, 4)
    (first, sizes), rest = results[0], results[1:]
    points = first["p2p_loaded/2"]
    # one point per probed size up to a micro-batch's activation, each a positive hand-off time,
    # the median over the pairs: the same on every rank
    assert [b for b, _ in points] == list(sizes[:3])
    assert all(0 < s < 1.0 for _, s in points)
    assert all(r[0] == first for r in rest)
