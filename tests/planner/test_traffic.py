"""Call lists of the trainer's collectives and their per-op pricing, against hand calculations (no processes)."""

from dataclasses import replace

import pytest

from tessel.planner.calibration import Calibration
from tessel.planner.cost import CostModel, all_reduce_time
from tessel.planner.layout import Layout
from tessel.planner.pricing import Chunk
from tessel.planner.traffic import (Call, bookkeeping_calls, bucket_sizes, dp_step_calls, ep_block_calls,
                                    fit_alpha_beta, merged, pp_calls, sent_bytes, tp_block_calls, tp_edge_calls,
                                    trainer_calls)
from tests.planner.cases import flat_cluster, tiny_spec

MiB = 2**20


def test_fit_recovers_a_line_and_weighs_small_calls():
    # exact points on t = 200 us + x / 500 MB/s: the fit returns them
    pts = [(x, 2e-4 + x / 5e8) for x in (64, 16384, 262144, 4194304)]
    alpha, beta = fit_alpha_beta(pts)
    assert alpha == pytest.approx(2e-4) and beta == pytest.approx(2e-9)
    assert fit_alpha_beta([(1000, 3e-3)]) == (3e-3, 0.0)  # one size: all latency
    # decreasing times (noise) give no negative bandwidth: the weighted mean of t is alpha
    a, b = fit_alpha_beta([(10, 2e-3), (1000, 1e-3)])
    assert b == 0.0 and 1e-3 < a < 2e-3


def test_tp_calls_per_block_by_hand():
    # d 32, 64 tokens, fp32: each activation is 64*32*4 = 8192 bytes
    fwd, bwd = tp_block_calls(32, 64, 4, sp=False)
    assert fwd == [Call("all_reduce", 8192, 2)] and bwd == [Call("all_reduce", 8192, 2)]  # g twice, f twice
    fwd, bwd = tp_block_calls(32, 64, 4, sp=True)
    assert fwd == [Call("all_gather", 8192, 2), Call("reduce_scatter", 8192, 2)]
    # backward mirrors them, plus the two norm weights' gradients (32 fp32 each) summed over tp
    assert bwd == [Call("reduce_scatter", 8192, 2), Call("all_gather", 8192, 2), Call("all_reduce", 128, 2)]


def test_tp_calls_of_embedding_head_and_loss():
    fwd, bwd = tp_edge_calls(32, 256, 64, 4, sp=False, first=True, last=True)
    # embedding leaves a region (g), head enters one (f, backward), loss: max of 64 rows, then 2x64 sums
    assert fwd == [Call("all_reduce", 8192), Call("all_reduce", 256), Call("all_reduce", 512)]
    assert bwd == [Call("all_reduce", 8192)]
    fwd, bwd = tp_edge_calls(32, 256, 64, 4, sp=True, first=False, last=True)
    assert fwd == [Call("all_gather", 8192), Call("all_reduce", 256), Call("all_reduce", 512)]
    assert bwd == [Call("reduce_scatter", 8192), Call("all_reduce", 128)]
    assert tp_edge_calls(32, 256, 64, 4, sp=True, first=False, last=False) == ([], [])


def test_ep_calls_by_hand():
    # 64 tokens, top-2, capacity 1.25, d 32, fp32: 64*2*1.25*32*4 = 20480 bytes routed each way
    fwd, bwd = ep_block_calls(32, 64, 4, 2, 1.25, 8)
    assert fwd == [Call("all_to_all", 64), Call("all_to_all", 20480, 2)]  # 8 int64 counts, then out and back
    assert bwd == [Call("all_to_all", 20480, 2)]


def test_buckets_and_dp_calls_by_hand():
    # 1 MiB first, then 9 MiB: two full 4 MiB buckets and the 1 MiB left
    assert bucket_sizes(10 * MiB, 4 * MiB) == [(MiB, 1), (4 * MiB, 2), (MiB, 1)]
    assert bucket_sizes(5 * MiB, 4 * MiB) == [(MiB, 1), (4 * MiB, 1)]
    assert bucket_sizes(0.5 * MiB, 4 * MiB) == [(0.5 * MiB, 1)]
    ar = [Call("all_reduce", MiB), Call("all_reduce", 4 * MiB, 2), Call("all_reduce", MiB)]
    ag = [Call("all_gather", MiB), Call("all_gather", 4 * MiB, 2), Call("all_gather", MiB)]
    assert dp_step_calls(10 * MiB, 0, 4 * MiB) == ([], ar)
    assert dp_step_calls(10 * MiB, 1, 4 * MiB) == ([], ar + ag)  # ZeRO-1: the updated shards gathered after
    per_mb, per_step = dp_step_calls(10 * MiB, 2, 4 * MiB)
    assert per_mb == [Call("reduce_scatter", c.nbytes, c.count) for c in ar] and per_step == ag
    # stage 3, three equal blocks and a root: blocks gathered twice (forward, backward), root once
    per_mb, per_step = dp_step_calls(10 * MiB, 3, 4 * MiB, [3 * MiB] * 3, MiB)
    assert sorted(per_mb, key=str) == sorted([Call("all_gather", 3 * MiB, 6), Call("all_gather", MiB, 1),
                                              Call("reduce_scatter", 3 * MiB, 3), Call("reduce_scatter", MiB, 1)],
                                             key=str)
    assert per_step == []
    # stage 3 under a pipeline: the whole stage gathered once per step, reduce-scattered once after the flush
    assert dp_step_calls(10 * MiB, 3, 4 * MiB, [3 * MiB] * 3, MiB, whole_step=True) == (
        [], [Call("all_gather", 10 * MiB), Call("reduce_scatter", 10 * MiB)])
    assert dp_step_calls(10 * MiB, 2, 4 * MiB, whole_step=True)[0] == []  # ZeRO-2 under a pipeline: once per step
    assert merged([Call("p2p", 1), Call("p2p", 1, 2), Call("p2p", 2)]) == [Call("p2p", 1, 3), Call("p2p", 2)]


def test_measured_fits_price_calls_and_formulas_stay_for_presets():
    cluster = replace(flat_cluster(devices=4, lat=1e-5), collectives={"all_reduce/2": [1e-3, 1e-9],
                                                                       "p2p/2": [2e-4, 0.0]})
    cm = CostModel(tiny_spec(), cluster, "fp32")
    link = cluster.intra
    assert cm.coll("all_reduce", 1e6, 2, link) == pytest.approx(1e-3 + 1e-3)
    assert cm.coll("all_reduce", 1e6, 4, link) == pytest.approx(all_reduce_time(1e6, 4, link))  # no fit: formula
    assert cm.coll("p2p", 123, 4, link) == pytest.approx(2e-4)  # p2p is always a pair
    assert cm.price([Call("all_reduce", 1e6, 3)], 2, link) == pytest.approx(3 * 2e-3)
    assert cm.coll("all_reduce", 1e6, 1, link) == 0.0
    # bytes sent on a ring: all-reduce 2(n-1)/n, the others (n-1)/n
    assert sent_bytes([Call("all_reduce", 100, 2), Call("all_gather", 100)], 4) == pytest.approx(300 + 75)


def test_pipeline_messages_are_priced_as_probed_under_load():
    # the probe's hand-off under a pipeline's load (tessel.calibrate.profile._p2p_under_load) prices every p2p
    # message, in the formula and in the simulator's link alike; the idle fit only where it was not probed
    idle = replace(flat_cluster(devices=4, lat=1e-5), collectives={"p2p/2": [5e-5, 1e-9]})
    loaded = replace(idle, collectives={**idle.collectives, "p2p_loaded/2": [6e-4, 2e-9]})
    lay = Layout(pp=2, dp=2, micro_batch=1, micro_batches=4)
    for cluster, (alpha, beta) in ((idle, (5e-5, 1e-9)), (loaded, (6e-4, 2e-9))):
        cm = CostModel(tiny_spec(), cluster, "fp32")
        assert cm.coll("p2p", 1000, 2, cluster.intra) == pytest.approx(alpha + beta * 1000)
        link = cm.message_link(cm.links(lay)["pp"])
        assert (link.latency, link.bandwidth) == (pytest.approx(alpha), pytest.approx(1 / beta))
        assert cm.estimate(lay).p2p_s == pytest.approx(alpha + beta * cm.pipeline.message_bytes(lay))
    # a preset's link is the network model's, whatever the probe says
    cm = CostModel(tiny_spec(), flat_cluster(devices=4, lat=1e-5), "fp32")
    assert cm.message_link(cm.links(lay)["pp"]) is cm.links(lay)["pp"]


def test_chunk_comm_of_a_tp_layout_by_hand():
    # tiny GPT (2 blocks, d 32, vocab 256), 16 tokens per micro-batch, tp 2, every all-reduce 1 ms flat
    cluster = replace(flat_cluster(devices=2), collectives={"all_reduce/2": [1e-3, 0.0]})
    cm = CostModel(tiny_spec(seq=16), cluster, "fp32")
    lay = Layout(tp=2, micro_batch=1)
    comm = cm.chunk_comm(lay, Chunk((0, 1), True, True, 16))
    fwd, bwd, sent = comm.fwd_s, comm.bwd_s, comm.sent
    # forward: 2 per block + embedding + the loss's two = 7; backward: 2 per block + head = 5
    assert (fwd, bwd) == (pytest.approx(7e-3), pytest.approx(5e-3))
    rc = replace(lay, recompute=True)
    assert cm.chunk_comm(rc, Chunk((0, 1), True, True, 16)).bwd_s == pytest.approx(9e-3)  # + 2 per block
    act = 16 * 32 * 4
    # 10 activation all-reduces, the loss's 16 and 32 floats; 2(n-1)/n = 1 at n = 2
    assert sent["tp"] == pytest.approx(10 * act + 64 + 128)


def test_calibration_per_tp_shape():
    cal = Calibration([(100, 1e9)], tp_points={1: [(100, 1e9)], 2: [(100, 1.5e9)]})
    assert cal.achieved(100, 0, tp=2) == 1.5e9  # measured on the sharded shapes
    # unprofiled tp: the work of tokens/tp rows per call, tp times over
    assert cal.achieved(400, 0, tp=4) == pytest.approx(4 * 1e9)


def test_measured_tp_collectives_scale_their_price():
    # same tiny GPT and flat 1 ms all-reduces as above: the whole model's tp calls at 16 tokens
    # are 12 (7 forward + 5 backward) = 12 ms idle; the profile measured 30 ms in a real step
    cluster = replace(flat_cluster(devices=2), collectives={"all_reduce/2": [1e-3, 0.0]})
    cal = Calibration([(16, 1e9)], tp_comm={2: [(16, 30e-3)]})
    cm = CostModel(tiny_spec(seq=16), cluster, "fp32", cal)
    lay = Layout(tp=2, micro_batch=1)
    comm = cm.chunk_comm(lay, Chunk((0, 1), True, True, 16))
    fwd, bwd = comm.fwd_s, comm.bwd_s
    assert (fwd, bwd) == (pytest.approx(7e-3 * 2.5), pytest.approx(5e-3 * 2.5))
    # a middle pipeline chunk (one block, no edges) scales by the same factor: 2 + 2 calls
    mid = cm.chunk_comm(lay, Chunk((1,), False, False, 16))
    assert (mid.fwd_s, mid.bwd_s) == (pytest.approx(2e-3 * 2.5), pytest.approx(2e-3 * 2.5))


def test_pipeline_messages_and_bookkeeping_by_hand():
    # 4 micro-batches of 4096-byte activations: an end stage sends one way and receives the other (8)
    assert pp_calls(4096, [0], 2, 4) == [Call("p2p", 4096, 8)] == pp_calls(4096, [1], 2, 4)
    assert pp_calls(4096, [1], 4, 4) == [Call("p2p", 4096, 16)]  # a middle stage: both boundaries
    # interleaved, pp 2 x v 2: stage 0 holds chunks 0 and 2 of 4, three boundaries
    assert pp_calls(4096, [0, 2], 4, 4) == [Call("p2p", 4096, 24)]
    assert pp_calls(4096, [0], 1, 4) == []
    # the loss: one message to each other stage from the last; norm partial sums per sharding axis
    last = bookkeeping_calls(tp=2, pp=4, dp_shards=2, zero=1, stage=3)
    assert last["pp"][1] == Call("p2p", 4, 3) and bookkeeping_calls(1, 4, 1, 0, 0)["pp"][1] == Call("p2p", 4, 1)
    assert last["tp"] == [Call("all_reduce", 4)] and last["dp"] == [Call("all_reduce", 4)]
    assert "dp" not in bookkeeping_calls(1, 1, 2, 0, 0)  # plain dp: the gradients are whole
    assert trainer_calls(1, 1) == {} and set(trainer_calls(4, 2)) == {"dp", "world"}
