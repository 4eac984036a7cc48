"""Collective algorithms built on point-to-point messages.

- `ring`: all-reduce as a ring reduce-scatter followed by a ring all-gather
  (Patarasuk & Yuan 2009, "Bandwidth optimal all-reduce algorithms for
  clusters of workstations"; the Baidu/Horovod ring). Each rank sends
  2(n-1)/n of the buffer, whatever n is. The buffer is cut into n chunks and
  every chunk into pieces; a piece moves on to the next step as soon as it has
  arrived and been added, so transfers and additions overlap (pipelining).
- `hierarchical`: intra-node ring reduce-scatter, inter-node ring all-reduce
  among the ranks with the same local rank, intra-node ring all-gather
  (Horovod's hierarchical all-reduce; Jia et al. 2018, "Highly scalable deep
  learning training system with mixed-precision"). Only 1/L of the buffer
  crosses the slow links per rank, L the ranks per node; with two nodes each
  node sends S bytes out instead of the flat ring's 1.5 S (for 2 x 2 ranks),
  so 1.5x is the bandwidth bound of its advantage there. On gloo, segments
  of the buffer flow through the three phases as a pipeline.
- `hierarchical_all_to_all`: ranks first aggregate, inside their node, all
  data bound for the same local rank of every node, then exchange one message
  per (node, node, local rank) between nodes (the idea of NCCL's PXN and of
  DeepSpeed-MoE's hierarchical all-to-all): L^2 small inter-node messages
  become L larger ones.
- `native`: the backend's own collective.

All functions take global ranks and a process group (None: the world); every
member of the group must call them in the same order. Sizes need not divide
the group: chunks are as even as possible and empty pieces are never sent.
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Sequence

import torch
import torch.distributed as dist

PIECE_BYTES = 1 << 20  # ~1 MiB pieces: big enough to amortize a message, small enough to pipeline
SEGMENT_BYTES = 2 << 20  # hierarchical all-reduce pipeline segment (ramped: see segment_sizes)
MAX_SEGMENTS = 16
TAG_INTRA_RS, TAG_INTER, TAG_INTRA_AG = 11, 12, 13  # one tag per pipelined phase (gloo matches by tag)


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


def _pieces(size: int, itemsize: int, piece_bytes: int) -> list[int]:
    return split_sizes(size, max(1, min(64, (size * itemsize) // max(1, piece_bytes))))


def _wait(works) -> None:
    # each work exactly once: a second wait() on a gloo p2p work waits for a second message
    for w in works:
        w.wait()


# ---- ring reduce-scatter / all-gather over a list of ranks -------------------
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
    scratch = [torch.empty(max(sizes), dtype=flat.dtype, device=flat.device) for _ in range(2)]
    sends, pending = [], {}
    for s in range(n - 1):
        c_send, c_recv = chunk(i - s - 1), chunk(i - s - 2)
        for j, (p_off, p_len) in enumerate(zip(offsets_of(piece_sizes), piece_sizes)):
            if s > 0 and j in pending:  # finish this piece of the previous step: it is what we send now
                works, buf, dst = pending.pop(j)
                _wait(works)
                dst.add_(buf)
            out = _piece(c_send, p_off, p_len)
            inc = _piece(c_recv, p_off, p_len)
            buf = scratch[s % 2].narrow(0, p_off, inc.numel())
            sent, got = exchange(out, nxt, buf, prv, group, tag)
            sends += sent
            if got:
                pending[j] = (got, buf, inc)
    for works, buf, dst in pending.values():
        _wait(works)
        dst.add_(buf)
    _wait(sends)
    return offs[i], sizes[i]


def _piece(chunk: torch.Tensor, off: int, length: int) -> torch.Tensor:
    """A piece of a chunk; chunks of uneven size simply have shorter (or empty) tail pieces."""
    off = min(off, chunk.numel())
    return chunk.narrow(0, off, max(0, min(length, chunk.numel() - off)))


def ring_all_gather_(flat: torch.Tensor, ranks: Sequence[int], group=None,
                     piece_bytes: int = PIECE_BYTES, tag: int = 0) -> None:
    """Each rank holds chunk (index in ranks) of `flat`; afterwards every rank holds all chunks."""
    n, i = len(ranks), list(ranks).index(dist.get_rank())
    if n == 1:
        return
    sizes = split_sizes(flat.numel(), n)
    offs = offsets_of(sizes)
    nxt, prv = ranks[(i + 1) % n], ranks[(i - 1) % n]
    chunk = lambda c: flat.narrow(0, offs[c % n], sizes[c % n])  # noqa: E731
    piece_sizes = _pieces(max(sizes), flat.element_size(), piece_bytes)
    works_all, pending = [], {}
    for s in range(n - 1):
        c_send, c_recv = chunk(i - s), chunk(i - s - 1)
        for j, (p_off, p_len) in enumerate(zip(offsets_of(piece_sizes), piece_sizes)):
            if j in pending:  # the piece we forward must have arrived
                _wait(pending.pop(j))
            out, inc = _piece(c_send, p_off, p_len), _piece(c_recv, p_off, p_len)
            sent, got = exchange(out, nxt, inc, prv, group, tag)  # received straight into place
            works_all += sent
            if got:
                pending[j] = got
    for got in pending.values():
        _wait(got)
    _wait(works_all)


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

    1. ring reduce-scatter inside the node: local rank l owns chunk l;
    2. ring all-reduce of chunk l among the ranks with local rank l on every node;
    3. ring all-gather inside the node.
    On gloo the buffer is cut into segments that flow through the three phases
    as a pipeline (one thread per phase, one message tag per phase), so the
    intra-node phases of one segment overlap the inter-node phase of another.
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
    stages = _HierStages(local, peers, group, piece_bytes, pipelined=len(sizes) > 1 and not _is_nccl(group))
    stages.run(segments)
    return tensor


def segment_sizes(n: int, seg: int) -> list[int]:
    """Pipeline segments of n elements, about `seg` each, the first and last ones smaller.

    The first segment's intra-node reduce-scatter and the last one's all-gather
    run alone (pipeline fill and drain); ramping them (seg/4, seg/2, ..., seg/2,
    seg/4) shortens both.
    """
    if n <= 2 * seg:
        return split_sizes(n, max(1, min(MAX_SEGMENTS, n // max(1, seg))))
    ramp = [seg // 4, seg // 2]
    middle = n - 2 * sum(ramp)
    k = max(1, min(MAX_SEGMENTS - 4, -(-middle // seg)))
    return [s for s in ramp + split_sizes(middle, k) + ramp[::-1] if s > 0]


class _HierStages:
    """The three phases of hierarchical all-reduce, run on segments in order, optionally pipelined."""

    def __init__(self, local, peers, group, piece_bytes, pipelined):
        self.local, self.peers, self.group, self.pb, self.pipelined = local, peers, group, piece_bytes, pipelined

    def intra_rs(self, seg):
        off, length = ring_reduce_scatter_(seg, self.local, self.group, self.pb, TAG_INTRA_RS)
        return seg.narrow(0, off, length)

    def post_swap(self, part):
        """Two nodes: a ring of two is "swap halves, then swap back"; swapping whole parts sends
        the same bytes in one round instead of two dependent ones (a + b == b + a, so both ends
        still agree bit for bit). Returns the function that completes it."""
        other = self.peers[1 - self.peers.index(dist.get_rank())]
        incoming = torch.empty_like(part)
        sent, got = exchange(part, other, incoming, other, self.group, TAG_INTER)

        def finish():
            _wait(got)
            _wait(sent)  # part may change only after it has left
            part.add_(incoming)
        return finish

    def inter(self, part):
        if len(self.peers) == 2:
            self.post_swap(part)()
            return
        ring_reduce_scatter_(part, self.peers, self.group, self.pb, TAG_INTER)
        ring_all_gather_(part, self.peers, self.group, self.pb, TAG_INTER)

    def intra_ag(self, seg):
        ring_all_gather_(seg, self.local, self.group, self.pb, TAG_INTRA_AG)

    def run(self, segments):
        if not self.pipelined:
            for seg in segments:
                self.inter(self.intra_rs(seg))
                self.intra_ag(seg)
            return
        import queue
        q_inter, q_gather = queue.Queue(), queue.Queue()

        def inter_stage():
            # two nodes: keep up to two segments' swaps in flight, so the slow link never idles
            # while a segment is being added or the next one is still in the intra stage
            in_flight = []
            try:
                for _ in segments:
                    item = q_inter.get()
                    if item is None:
                        return
                    if len(self.peers) == 2:
                        in_flight.append((item[0], self.post_swap(item[1])))
                        if len(in_flight) > 1:
                            seg, swap = in_flight.pop(0)
                            swap()
                            q_gather.put(seg)
                    else:
                        self.inter(item[1])
                        q_gather.put(item[0])
                for seg, swap in in_flight:
                    swap()
                    q_gather.put(seg)
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


# ---- all-to-all ----------------------------------------------------------------
def hierarchical_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                            nodes: Sequence[Sequence[int]], group=None) -> list[torch.Tensor]:
    """dist.all_to_all semantics (lists indexed by group rank), in two phases.

    1. inside the node, send local rank m everything bound for local rank m of
       any node (with a header of sizes, which only the final receiver knows);
    2. between nodes, local rank m sends node b one message: the data of all
       its node's ranks for rank (b, m). Receivers know these sizes from outputs.
    """
    ranks = group_ranks(group)
    nodes = restrict_nodes(nodes, ranks)
    me = dist.get_rank()
    if len({len(n) for n in nodes}) != 1:
        raise ValueError("hierarchical all-to-all needs the same number of ranks on every node")
    gidx = {r: k for k, r in enumerate(ranks)}
    a = next(k for k, n in enumerate(nodes) if me in n)
    l, local, dtype, dev = nodes[a].index(me), nodes[a], inputs[0].dtype, inputs[0].device
    # phase 1: to local peer m, [data for (b, m) for b in nodes], sizes first
    held = _phase_intra(inputs, nodes, local, l, gidx, dtype, dev, group)  # held[l'][b]: (a,l') -> (b,l)
    # phase 2: to (b, l), the concatenation over l' of held[l'][b]
    recv_bufs, works = {}, []
    for b, node in enumerate(nodes):
        payload = torch.cat([held[lp][b] for lp in range(len(local))])
        srcs = [gidx[r] for r in node]  # what (b, l) sends me: from (b, l') for every l'
        size = sum(outputs[s].numel() for s in srcs)
        if node[l] == me:
            recv_bufs[b] = payload
            continue
        recv_bufs[b] = torch.empty(size, dtype=dtype, device=dev)
        works += sum(exchange(payload, node[l], recv_bufs[b], node[l], group), [])
    _wait(works)
    for b, node in enumerate(nodes):
        parts = recv_bufs[b].split([outputs[gidx[r]].numel() for r in node])
        for r, part in zip(node, parts):
            outputs[gidx[r]].copy_(part.view_as(outputs[gidx[r]]))
    return outputs


def _phase_intra(inputs, nodes, local, l, gidx, dtype, dev, group):
    me_sizes, works, held = {}, [], {}
    headers = {}
    for m, peer in enumerate(local):  # sizes go first, so receivers can allocate
        me_sizes[m] = torch.tensor([inputs[gidx[node[m]]].numel() for node in nodes], dtype=torch.int64, device=dev)
        headers[m] = torch.empty(len(nodes), dtype=torch.int64, device=dev)
        if m == l:
            headers[m].copy_(me_sizes[m])
        else:
            works += sum(exchange(me_sizes[m], peer, headers[m], peer, group), [])
    _wait(works)
    works = []
    for m, peer in enumerate(local):
        payload = torch.cat([inputs[gidx[node[m]]].reshape(-1) for node in nodes]) if nodes else None
        sizes = headers[m].tolist()
        if m == l:
            buf = payload
        else:
            buf = torch.empty(sum(sizes), dtype=dtype, device=dev)
            works += sum(exchange(payload, peer, buf, peer, group), [])
        held[m] = (buf, sizes)
    _wait(works)
    return {m: list(buf.split(sizes)) for m, (buf, sizes) in held.items()}


def native_all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group=None) -> list[torch.Tensor]:
    """The backend's all-to-all for uneven sizes (gloo's list form wants equal ones): one flat buffer."""
    flat_in = torch.cat([t.reshape(-1) for t in inputs])
    flat_out = torch.empty(sum(t.numel() for t in outputs), dtype=flat_in.dtype, device=flat_in.device)
    dist.all_to_all_single(flat_out, flat_in, [t.numel() for t in outputs], [t.numel() for t in inputs],
                           group=group)
    for t, part in zip(outputs, flat_out.split([t.numel() for t in outputs])):
        t.copy_(part.view_as(t))
    return outputs


def native_reduce_scatter(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(output, input, group=group)
    return output


def native_all_gather(output: torch.Tensor, input: torch.Tensor, group=None) -> torch.Tensor:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(output, input, group=group)
    return output
