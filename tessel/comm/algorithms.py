"""Collective algorithms built on point-to-point messages.

- `ring`: all-reduce as a ring reduce-scatter followed by a ring all-gather
  (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations"; the Baidu/Horovod ring). Each rank sends
  2(n-1)/n of the buffer, whatever n is. The buffer is cut into n chunks and
  every chunk into pieces; a piece moves on to the next step as soon as it has
  arrived and been added, so transfers and additions overlap (pipelining).
- `hierarchical`: intra-node reduce-scatter, inter-node all-reduce among the
  ranks with the same local rank, intra-node all-gather (Horovod's
  hierarchical all-reduce; Jia et al. 2018, "Highly scalable deep learning
  training system with mixed-precision"). Only 1/L of the buffer crosses the
  slow links per rank, L the ranks per node; with two nodes each node sends
  S bytes out instead of the flat ring's 1.5 S (for 2 x 2 ranks), so 1.5x is
  the bandwidth bound of its advantage there. On gloo, segments of the buffer
  flow through the three phases as a pipeline.
- `native`: the backend's own collective.
(The hierarchical all-to-all is in tessel.comm.all_to_all.)

All functions take global ranks and a process group (None: the world); every
member of the group must call them in the same order. Sizes need not divide
the group: chunks are as even as possible and empty pieces are never sent.
"""

from __future__ import annotations

import concurrent.futures as cf
import queue
import threading
from typing import Sequence

import torch
import torch.distributed as dist

PIECE_BYTES = 4 << 20  # 4 MiB pieces: on the emulator (1 Gbit/s) the ring ran 7-11% faster than with 1 MiB
SEGMENT_BYTES = 2 << 20  # hierarchical all-reduce pipeline segment (ramped: see segment_sizes)
MAX_SEGMENTS = 16
RS_AHEAD = 2  # segments whose intra-node reduce-scatter is in flight ahead of the one being added
TAG_INTRA_RS, TAG_INTER, TAG_INTRA_AG = 11, 12, 13  # one tag per pipelined phase (gloo matches by tag)
WORKSPACE_MAX_BYTES = 64 << 20  # receive buffers up to this size are kept for the next call


# ---- small helpers ------------------------------------------------------------
def group_ranks(group=None) -> list[int]:
    """Global ranks of `group` in group order."""
    if group is None or group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def split_sizes(n: int, parts: int) -> list[int]:
    """n items into `parts` near-equal counts, the larger ones first: 7, 3 -> [3, 2, 2]."""
    base, extra = divmod(n, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def offsets_of(sizes: Sequence[int]) -> list[int]:
    out, acc = [], 0
    for s in sizes:
        out.append(acc)
        acc += s
    return out


def _is_nccl(group) -> bool:
    return dist.get_backend(group) == "nccl"


def exchange(send: torch.Tensor | None, dst: int, recv: torch.Tensor | None, src: int,
             group=None, tag: int = 0) -> tuple[list, list]:
    """Post one send and one receive (either may be None or empty); returns (send works, recv works).

    NCCL needs the pair in one batch (ncclGroupStart/End) or a ring of blocking
    kernels could wait on each other; gloo takes them separately.
    """
    ops = []
    if send is not None and send.numel():
        ops.append(dist.P2POp(dist.isend, send, dst, group, tag))
    if recv is not None and recv.numel():
        ops.append(dist.P2POp(dist.irecv, recv, src, group, tag))
    if not ops:
        return [], []
    if _is_nccl(group):
        works = dist.batch_isend_irecv(ops)
    else:
        works = [op.op(op.tensor, op.peer, op.group, op.tag) for op in ops]
    n_send = 1 if send is not None and send.numel() else 0
    return works[:n_send], works[n_send:]


_workspace = threading.local()


def scratch(numel: int, like: torch.Tensor) -> torch.Tensor:
    """A (numel,) receive buffer of `like`'s dtype, reused by this thread's next call.

    On the CPU a fresh buffer's pages fault in as the first bytes land: an 8 MiB
    buffer took 5.2 ms to fill fresh and 0.8 ms again, so a fresh receive
    buffer per call cost every rank ~0.55 ms of CPU per MiB, which four ranks on
    two cores pay in delays on the critical path. One buffer per thread (the
    DP reducer drives its algorithm from one worker thread; every call here
    finishes before it returns) and dtype; accelerators keep their own caching allocators.
    """
    nbytes = numel * like.element_size()
    if like.device.type != "cpu" or nbytes > WORKSPACE_MAX_BYTES:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    bufs = _workspace.__dict__.setdefault("by_dtype", {})
    buf = bufs.get(like.dtype)
    if buf is None or buf.numel() < numel:
        buf = bufs[like.dtype] = torch.empty(numel, dtype=like.dtype)
    return buf[:numel]


def _pieces(size: int, itemsize: int, piece_bytes: int) -> list[int]:
    return split_sizes(size, max(1, min(64, (size * itemsize) // max(1, piece_bytes))))


def _wait(works) -> None:
    # each work exactly once: a second wait() on a gloo p2p work waits for a second message
    for w in works:
        w.wait()


# ---- ring reduce-scatter / all-gather over a list of ranks -------------------
def _early(group) -> bool:
    """Announce every receive before the first send (gloo), or pair each with its send (NCCL).

    gloo moves a message only once the receiver has announced its buffer; announced just in
    time, that announcement travels while the reverse direction of a link is busy with data
    and the sender idles for the round trip. NCCL runs p2p in stream order: receives posted
    ahead of the sends that feed their senders would wait on each other forever.
    """
    return not _is_nccl(group)


def ring_reduce_scatter_(flat: torch.Tensor, ranks: Sequence[int], group=None,
                         piece_bytes: int = PIECE_BYTES, tag: int = 0) -> tuple[int, int]:
    """Sum `flat` over `ranks` in place; afterwards this rank's chunk (index in ranks) is reduced.

    flat: (N,) contiguous. Returns (offset, length) of the chunk this rank owns.
    Step s sends chunk (i-s-1) to the next rank and adds chunk (i-s-2) from the
    previous one, so after n-1 steps chunk i holds the sum.
    """
    n, i = len(ranks), list(ranks).index(dist.get_rank())
    sizes = split_sizes(flat.numel(), n)
    offs = offsets_of(sizes)
    if n == 1:
        return offs[i], sizes[i]
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    chunk = lambda c: flat.narrow(0, offs[c % n], sizes[c % n])  # noqa: E731
    # the same piece split for every chunk keeps sender and receiver aligned
    piece_sizes = _pieces(max(sizes), flat.element_size(), piece_bytes)
    pieces = list(enumerate(zip(offsets_of(piece_sizes), piece_sizes)))
    early = _early(group)
    # early: one buffer per step; else two, reused every other step (a piece is added before
    # the step after next receives into its place)
    rows = n - 1 if early else 2
    recv_rows = scratch(rows * max(sizes), flat).view(rows, max(sizes))

    def target(s, off, length):  # where step s receives a piece, and what it is added to
        inc = _piece(chunk(i - s - 2), off, length)
        return recv_rows[s if early else s % 2].narrow(0, off, inc.numel()), inc

    pending = {}
    if early:
        for s in range(n - 1):
            for j, (off, length) in pieces:
                buf, inc = target(s, off, length)
                pending[s, j] = (exchange(None, nxt, buf, prv, group, tag)[1], buf, inc)
    sends = []
    for s in range(n - 1):
        for j, (off, length) in pieces:
            if s > 0:  # finish this piece of the previous step: it is what we send now
                works, buf, dst = pending.pop((s - 1, j))
                _wait(works)
                dst.add_(buf)
            out = _piece(chunk(i - s - 1), off, length)
            if early:
                sends += exchange(out, nxt, None, prv, group, tag)[0]
            else:
                buf, inc = target(s, off, length)
                sent, got = exchange(out, nxt, buf, prv, group, tag)
                sends += sent
                pending[s, j] = (got, buf, inc)
    for works, buf, dst in pending.values():
        _wait(works)
        dst.add_(buf)
    _wait(sends)
    return offs[i], sizes[i]


def _piece(chunk: torch.Tensor, off: int, length: int) -> torch.Tensor:
    """A piece of a chunk; chunks of uneven size simply have shorter (or empty) tail pieces."""
    off = min(off, chunk.numel())
    return chunk.narrow(0, off, max(0, min(length, chunk.numel() - off)))


def _cut(flat: torch.Tensor, parts: int) -> list[torch.Tensor]:
    """`flat` as `parts` near-equal chunks (views), the same boundaries as the ring's."""
    sizes = split_sizes(flat.numel(), parts)
    return [flat.narrow(0, o, z) for o, z in zip(offsets_of(sizes), sizes)]


def ring_all_gather_(flat: torch.Tensor, ranks: Sequence[int], group=None,
                     piece_bytes: int = PIECE_BYTES, tag: int = 0) -> None:
    """Each rank holds chunk (index in ranks) of `flat`; afterwards every rank holds all chunks.

    Pieces are received straight into place; each chunk is received once, and forwarded
    only after it has arrived.
    """
    n, i = len(ranks), list(ranks).index(dist.get_rank())
    if n == 1:
        return
    sizes = split_sizes(flat.numel(), n)
    offs = offsets_of(sizes)
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    chunk = lambda c: flat.narrow(0, offs[c % n], sizes[c % n])  # noqa: E731
    piece_sizes = _pieces(max(sizes), flat.element_size(), piece_bytes)
    pieces = list(enumerate(zip(offsets_of(piece_sizes), piece_sizes)))
    early = _early(group)
    pending = {}
    if early:
        for s in range(n - 1):
            for j, (off, length) in pieces:
                pending[s, j] = exchange(None, nxt, _piece(chunk(i - s - 1), off, length), prv, group, tag)[1]
    sends = []
    for s in range(n - 1):
        for j, (off, length) in pieces:
            if s > 0:  # the piece we forward must have arrived
                _wait(pending.pop((s - 1, j)))
            out = _piece(chunk(i - s), off, length)
            if early:
                sends += exchange(out, nxt, None, prv, group, tag)[0]
            else:
                sent, pending[s, j] = exchange(out, nxt, _piece(chunk(i - s - 1), off, length), prv, group, tag)
                sends += sent
    for got in pending.values():
        _wait(got)
    _wait(sends)


# ---- all-reduce ---------------------------------------------------------------
def ring_all_reduce(tensor: torch.Tensor, group=None, piece_bytes: int = PIECE_BYTES) -> torch.Tensor:
    """In-place sum over `group`: ring reduce-scatter, then ring all-gather."""
    flat = _flat_view(tensor)
    ranks = group_ranks(group)
    ring_reduce_scatter_(flat, ranks, group, piece_bytes)
    ring_all_gather_(flat, ranks, group, piece_bytes)
    return tensor


def hierarchical_all_reduce(tensor: torch.Tensor, nodes: Sequence[Sequence[int]], group=None,
                            piece_bytes: int = PIECE_BYTES, segment_bytes: int = SEGMENT_BYTES) -> torch.Tensor:
    """In-place sum over `group`, given the group's ranks grouped by node (global ranks).

    1. reduce-scatter inside the node: local rank l owns chunk l;
    2. all-reduce of chunk l among the ranks with local rank l on every node;
    3. all-gather inside the node.
    On gloo the buffer is cut into segments that flow through the three phases
    as a pipeline, so the intra-node phases of some segments overlap the
    inter-node phase of others, and every local rank's inter-node stream runs
    at once. Two nodes (the common case, and the emulator's): every message is
    posted as early as its data allows, no threads (see _HierStages._run_swap);
    more nodes: one thread per phase, rings inside and between nodes.
    """
    flat = _flat_view(tensor)
    nodes = restrict_nodes(nodes, group_ranks(group))
    me = dist.get_rank()
    local = next(n for n in nodes if me in n)
    if len({len(n) for n in nodes}) != 1 or len(nodes) == 1 or len(local) == 1:
        # ragged nodes have no same-local-rank peers for everyone; one node or one rank
        # per node is a flat ring anyway
        return ring_all_reduce(tensor, group, piece_bytes)
    peers = [n[local.index(me)] for n in nodes]
    sizes = segment_sizes(flat.numel(), max(1, segment_bytes // flat.element_size()))
    segments = [flat.narrow(0, o, z) for o, z in zip(offsets_of(sizes), sizes)]
    # NCCL orders p2p by stream, not tag: keep its phases sequential
    stages = _HierStages(local, peers, group, piece_bytes, pipelined=not _is_nccl(group))
    stages.run(segments)
    return tensor


def segment_sizes(n: int, seg: int) -> list[int]:
    """Pipeline segments of n elements, about `seg` each, the first and last ones smaller.

    The first segment's intra-node reduce-scatter and the last one's all-gather
    run alone (pipeline fill and drain); ramping them (seg/8, seg/4, seg/2, ...,
    seg/2, seg/4, seg/8) shortens both. On the emulator the three-step ramp took
    16 MiB in 163 ms (median of 9) where a two-step one took 175.
    """
    if n <= 2 * seg:
        return split_sizes(n, max(1, min(MAX_SEGMENTS, n // max(1, seg))))
    ramp = [seg // 8, seg // 4, seg // 2]
    middle = n - 2 * sum(ramp)
    k = max(1, min(MAX_SEGMENTS - 2 * len(ramp), -(-middle // seg)))
    return [s for s in ramp + split_sizes(middle, k) + ramp[::-1] if s > 0]


class _HierStages:
    """The three phases of hierarchical all-reduce, run on segments in order, optionally pipelined."""

    def __init__(self, local, peers, group, piece_bytes, pipelined):
        self.local, self.peers, self.group, self.pb, self.pipelined = local, peers, group, piece_bytes, pipelined

    def intra_rs(self, seg):
        off, length = ring_reduce_scatter_(seg, self.local, self.group, self.pb, TAG_INTRA_RS)
        return seg.narrow(0, off, length)

    @property
    def other(self) -> int:
        return self.peers[1 - self.peers.index(dist.get_rank())]

    def inter(self, part):
        if len(self.peers) == 2:
            # a ring of two is "swap halves, then swap back"; swapping whole parts sends the
            # same bytes in one round instead of two dependent ones (a + b == b + a, so both
            # ends still agree bit for bit)
            incoming = torch.empty_like(part)
            sent, got = exchange(part, self.other, incoming, self.other, self.group, TAG_INTER)
            _wait(got)
            _wait(sent)
            part.add_(incoming)
            return
        ring_reduce_scatter_(part, self.peers, self.group, self.pb, TAG_INTER)
        ring_all_gather_(part, self.peers, self.group, self.pb, TAG_INTER)

    def intra_ag(self, seg):
        ring_all_gather_(seg, self.local, self.group, self.pb, TAG_INTRA_AG)

    def run(self, segments):
        if self.pipelined and len(self.peers) == 2:
            self._run_swap(segments)
        elif self.pipelined and len(segments) > 1:
            self._run_threads(segments)
        else:
            for seg in segments:
                self.inter(self.intra_rs(seg))
                self.intra_ag(seg)

    def _run_swap(self, segments):
        """Two nodes, pipelined by posting every message as early as its data allows.

        Inside a node the reduce-scatter and the all-gather are direct (local rank j sends
        chunk j straight to j: the ring's bytes in one round, which loopback or shared memory
        carries easily); between nodes each rank swaps its reduced part with its peer.
        1. every receive of every phase and segment is announced early: gloo moves a
           message only after the receiver has announced its buffer, and that announcement
           would otherwise queue behind data on the loaded reverse direction of the slow link.
           Only the first segments' receives come before the first part leaves for the other
           node, the rest right after: posting all ~40 first put 1-5 ms (and with four ranks
           on two cores, the odd preemption) before the slow link's first byte;
        2. intra-node reduce-scatter messages go RS_AHEAD segments ahead of the one being added
           (they depend on nothing; sending them all at once would spend the CPU on loopback
           copies just when the first part should leave for the slow link);
        3. segment by segment, the local contributions are added and the part leaves for the
           other node: the slow link starts after one small segment and never waits;
        4. segment by segment, as parts come back, they are added and sent to the local ranks.
        A chunk received in the all-gather lands in place: it can only arrive after its owner
        has received (so we have finished sending) our contribution to that chunk.
        """
        g, me, other = self.group, dist.get_rank(), self.other
        cuts = [_cut(seg, len(self.local)) for seg in segments]
        idx = {r: j for j, r in enumerate(self.local)}
        peers = [r for r in self.local if r != me]
        mine = [c[idx[me]] for c in cuts]
        # receive buffers: per segment, one per local peer (reduce-scatter) and one from the other node
        space = scratch(len(self.local) * sum(m.numel() for m in mine), mine[0])
        offs = offsets_of([m.numel() for m in mine for _ in self.local])
        views = [space.narrow(0, o, m.numel()) for o, m in zip(offs, (m for m in mine for _ in self.local))]
        per = len(self.local)
        rs_buf = [views[k * per:(k + 1) * per - 1] for k in range(len(mine))]
        inter_buf = [views[(k + 1) * per - 1] for k in range(len(mine))]
        post_rs = lambda bufs: [exchange(None, me, b, r, g, TAG_INTRA_RS)[1] for b, r in zip(bufs, peers)]  # noqa: E731
        post_inter = lambda b: exchange(None, other, b, other, g, TAG_INTER)[1]  # noqa: E731
        rs_send = lambda c: [w for r in peers for w in exchange(c[idx[r]], r, None, me, g, TAG_INTRA_RS)[0]]  # noqa: E731
        head = min(RS_AHEAD, len(cuts))
        rs_recv = [post_rs(bufs) for bufs in rs_buf[:head]]
        inter_recv = [post_inter(inter_buf[0])]
        sends = [w for c in cuts[:head] for w in rs_send(c)]
        inter_sent, ag_recv = [], []
        for k, (m, bufs) in enumerate(zip(mine, rs_buf)):
            if k and k + RS_AHEAD < len(cuts):
                sends += rs_send(cuts[k + RS_AHEAD])
            for works, buf in zip(rs_recv[k], bufs):
                _wait(works)
                m.add_(buf)
            inter_sent.append(exchange(m, other, None, other, g, TAG_INTER)[0])
            if k == 0:  # the slow link is busy now: announce every other receive
                inter_recv += [post_inter(b) for b in inter_buf[1:]]
                rs_recv += [post_rs(bufs) for bufs in rs_buf[head:]]
                ag_recv = [exchange(None, me, c[idx[r]], r, g, TAG_INTRA_AG)[1] for c in cuts for r in peers]
                if RS_AHEAD < len(cuts):
                    sends += rs_send(cuts[RS_AHEAD])
        for m, got, buf, sent in zip(mine, inter_recv, inter_buf, inter_sent):
            _wait(got)
            _wait(sent)  # the part may change only after it has left
            m.add_(buf)  # a + b == b + a: both nodes agree bit for bit
            sends += [w for r in peers for w in exchange(m, r, None, me, g, TAG_INTRA_AG)[0]]
        for works in ag_recv:
            _wait(works)
        _wait(sends)

    def _run_threads(self, segments):
        """More than two nodes: one thread per phase, segments handed on through queues."""
        q_inter, q_gather = queue.Queue(), queue.Queue()

        def inter_stage():
            try:
                for _ in segments:
                    item = q_inter.get()
                    if item is None:
                        return
                    self.inter(item[1])
                    q_gather.put(item[0])
            finally:
                q_gather.put(None)  # harmless after the last segment; unblocks the gatherer on error

        def gather_stage():
            for _ in segments:
                seg = q_gather.get()
                if seg is None:
                    raise RuntimeError("hierarchical all-reduce: the inter-node stage failed")
                self.intra_ag(seg)

        with cf.ThreadPoolExecutor(2, thread_name_prefix="tessel-hier") as pool:
            futures = [pool.submit(inter_stage), pool.submit(gather_stage)]
            try:
                for seg in segments:
                    q_inter.put((seg, self.intra_rs(seg)))
            finally:
                q_inter.put(None)
            for f in futures:
                f.result()


def native_all_reduce(tensor: torch.Tensor, group=None) -> torch.Tensor:
    dist.all_reduce(tensor, group=group)
    return tensor


def restrict_nodes(nodes: Sequence[Sequence[int]], members: Sequence[int]) -> list[list[int]]:
    """Node lists cut down to the group's members, in group order, empty nodes dropped."""
    where = {r: k for k, node in enumerate(nodes) for r in node}
    missing = [r for r in members if r not in where]
    if missing:
        raise ValueError(f"ranks {missing} are on no node of the topology")
    out: dict[int, list[int]] = {}
    for r in members:
        out.setdefault(where[r], []).append(r)
    return list(out.values())


def _flat_view(tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_contiguous():
        raise ValueError("p2p collectives need a contiguous tensor")
    return tensor.view(-1)


# ---- reduce-scatter and all-gather with native semantics ---------------------
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """reduce_scatter_tensor semantics: input is n equal chunks; output gets the sum of chunk `rank`."""
    n = len(group_ranks(group))
    flat = _flat_view(input.clone())
    if flat.numel() != n * output.numel():
        raise ValueError("input must hold group-size times the output's elements")
    # equal chunks: split_sizes gives the same boundaries as the native op
    off, length = ring_reduce_scatter_(flat, group_ranks(group), group)
    output.view(-1).copy_(flat.narrow(0, off, length))
    return output


def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    """all_gather_into_tensor semantics: output is the concatenation of every rank's input."""
    ranks = group_ranks(group)
    flat = _flat_view(output)
    if flat.numel() != len(ranks) * input.numel():
        raise ValueError("output must hold group-size times the input's elements")
    flat.narrow(0, ranks.index(dist.get_rank()) * input.numel(), input.numel()).copy_(input.reshape(-1))
    ring_all_gather_(flat, ranks, group)
    return output


# torch >= 2.13 names the single-tensor collectives *_single; older ones *_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    reduce_scatter_single(output, input, group=group)
    return output


def native_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    all_gather_single(output, input, group=group)
    return output
