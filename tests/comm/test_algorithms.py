"""p2p collectives equal the backend's own on awkward sizes (empty, 1 element, not divisible)."""

import torch
import torch.distributed as dist
from torch.testing import assert_close

from tessel.calibrate import bench as B
from tessel.comm import algorithms as A
from tessel.comm import all_to_all as X
from tessel.spawn import spawn

SIZES = [0, 1, 2, 7, 1001]  # empty, one element, fewer than ranks, not divisible, several pieces
PIECE = 64  # bytes: forces many pipelined pieces even on tiny buffers


def _data(n, rank, dtype=torch.float64, salt=0):
    g = torch.Generator().manual_seed(1000 * salt + 17 * rank + n)
    return torch.randn(n, generator=g, dtype=torch.float64).to(dtype)


def _all_reduce_cases(nodes):
    out = []
    rank, world = dist.get_rank(), dist.get_world_size()
    groups = {"world": None}
    if world == 4:  # a subgroup whose members are not 0..k-1 exercises global-rank handling
        sub = [dist.new_group([1, 2, 3])]
        groups["sub"] = sub[0] if rank in (1, 2, 3) else "skip"
    for gname, group in groups.items():
        if group == "skip":
            continue
        for n in SIZES:
            for dtype in (torch.float64, torch.float32):
                x = _data(n, rank, dtype)
                want = x.clone()
                dist.all_reduce(want, group=group)
                ring = A.ring_all_reduce(x.clone(), group, piece_bytes=PIECE)
                hier = A.hierarchical_all_reduce(x.clone(), nodes, group, piece_bytes=PIECE)
                # tiny segments: many segments in flight at once
                piped = A.hierarchical_all_reduce(x.clone(), nodes, group, piece_bytes=PIECE, segment_bytes=256)
                out.append((gname, n, str(dtype), want, ring, hier))
                out.append((gname + "-pipelined", n, str(dtype), want, ring, piped))
                if group is None:  # the threaded pipeline used for more than two nodes, run on two
                    out.append((gname + "-threads", n, str(dtype), want, ring, _threaded(x.clone(), nodes)))
    return out


def _threaded(x, nodes):
    me = dist.get_rank()
    local = next(n for n in nodes if me in n)
    stages = A._HierStages(local, [n[local.index(me)] for n in nodes], None, PIECE, pipelined=True)
    sizes = A.segment_sizes(x.numel(), 3)
    stages._run_threads([x.narrow(0, o, z) for o, z in zip(A.offsets_of(sizes), sizes)])
    return x


def _rs_ag_cases():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for per in (0, 1, 5):
        x = _data(per * world, rank)
        want = torch.empty(per, dtype=x.dtype)
        A.native_reduce_scatter(want, x.clone())
        got = A.ring_reduce_scatter(torch.empty(per, dtype=x.dtype), x)
        y = _data(per, rank, salt=1)
        want_ag = torch.empty(per * world, dtype=y.dtype)
        A.native_all_gather(want_ag, y)
        got_ag = A.ring_all_gather(torch.empty(per * world, dtype=y.dtype), y)
        out.append((per, want, got, want_ag, got_ag))
    return out


def _a2a_cases(nodes):
    rank, world = dist.get_rank(), dist.get_world_size()
    out = []
    for trial in range(3):
        # uneven sizes per (src, dst), zeros included, known to both ends
        size = lambda s, d: (s * 3 + d * 5 + trial * 7) % 4  # noqa: E731
        inputs = [_data(size(rank, d) * 2, rank, salt=trial + 10 * d).view(-1, 2) for d in range(world)]
        want = [torch.empty(size(s, rank), 2, dtype=torch.float64) for s in range(world)]
        got = [torch.full_like(t, float("nan")) for t in want]
        flat_want = torch.empty(sum(t.numel() for t in want), dtype=torch.float64)
        dist.all_to_all_single(flat_want, torch.cat([t.reshape(-1) for t in inputs]),
                               [t.numel() for t in want], [t.numel() for t in inputs])
        want = [p.view_as(t) for p, t in zip(flat_want.split([t.numel() for t in want]), want)]
        X.hierarchical_all_to_all(got, inputs, nodes)
        out.append((want, got))
    return out


def _run(nodes):
    rows = B.run(B.OPS, [], [64, 1000], nodes, iters=1, warmup=0)  # `tessel bench comm`'s engine
    return _all_reduce_cases(nodes), _rs_ag_cases(), _a2a_cases(nodes), rows


def _check(results):
    rows = results[0][3]
    assert {(r.op, r.algorithm) for r in rows} == {(op, a) for op, algos in B.ALGORITHMS.items() for a in algos}
    for r in rows:
        assert r.time_us > 0 and r.busbw == r.algbw * B.bus_factor(r.op, 4)
    assert B.bus_factor("all_reduce", 4) == 1.5 and B.bus_factor("all_to_all", 4) == 0.75
    assert B.parse_size("16M") == 16 << 20 and B.parse_size("4K") == 4096
    for rank, (ar, rsag, a2a, _) in enumerate(results):
        assert ar, "no all-reduce case ran"
        for gname, n, dtype, want, ring, hier in ar:
            # float64 sums in a different order than gloo: a few ulps at most
            tol = dict(rtol=1e-12, atol=1e-12) if "64" in dtype else dict(rtol=1e-5, atol=1e-6)
            assert ring.shape == want.shape == hier.shape == (n,)
            assert_close(ring, want, **tol, msg=f"ring rank {rank} {gname} n={n} {dtype}")
            assert_close(hier, want, **tol, msg=f"hier rank {rank} {gname} n={n} {dtype}")
        for per, want, got, want_ag, got_ag in rsag:
            assert_close(got, want, rtol=1e-12, atol=1e-12)
            assert torch.equal(got_ag, want_ag)  # a gather only moves bytes
        for want, got in a2a:
            for w, g in zip(want, got):
                assert torch.equal(g, w)


def test_collectives_match_native_two_nodes_of_two():
    # world: two nodes of two (hierarchical runs all three phases); the subgroup {1, 2, 3} has
    # 3 members (sizes not divisible) on ragged nodes {1} and {2, 3} (hierarchical falls back to ring)
    _check(spawn(_run, 4, [[0, 1], [2, 3]]))


def _hier_layouts():
    rank, out = dist.get_rank(), []
    for nodes in ([[0, 1], [2, 3], [4, 5]], [[0, 1, 2], [3, 4, 5]]):  # 3 nodes x 2, 2 nodes x 3
        for n in SIZES:
            x = _data(n, rank)
            want = x.clone()
            dist.all_reduce(want)
            got = A.hierarchical_all_reduce(x.clone(), nodes, piece_bytes=PIECE, segment_bytes=256)
            out.append((nodes, n, want, got))
    return out


def test_hierarchical_on_three_nodes_and_three_ranks_per_node():
    # more than two nodes takes the threaded pipeline with rings between nodes; three ranks per
    # node makes chunks that do not divide evenly inside the node
    for rank, cases in enumerate(spawn(_hier_layouts, 6)):
        for nodes, n, want, got in cases:
            # float64 sums of 6 values in another order than gloo's: a few ulps at most
            assert_close(got, want, rtol=1e-12, atol=1e-12, msg=f"rank {rank} nodes {nodes} n={n}")


def test_scratch_buffers_are_reused_per_thread_and_fresh_past_the_cap():
    like32, like64 = torch.empty(0), torch.empty(0, dtype=torch.float64)
    a = A.scratch(100, like32)
    assert A.scratch(50, like32).data_ptr() == a.data_ptr()  # smaller: the same memory again
    assert A.scratch(10, like64).dtype == torch.float64  # another dtype: its own buffer
    big = A.WORKSPACE_MAX_BYTES // 4 + 1
    first, second = A.scratch(big, like32), A.scratch(big, like32)  # both alive: distinct memory unless cached
    assert first.data_ptr() != second.data_ptr()
    assert A.scratch(100, like32).data_ptr() == a.data_ptr()  # the cached one was left alone
