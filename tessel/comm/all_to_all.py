"""All-to-all for expert dispatch: the backend's own, and a hierarchical one built on point-to-point.

`hierarchical_all_to_all`: ranks first aggregate, inside their node, all data
bound for the same local rank of every node, then exchange one message per
(node, node, local rank) between nodes (the idea of NCCL's PXN and of
DeepSpeed-MoE's hierarchical all-to-all): L^2 small inter-node messages become
L larger ones.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.distributed as dist

from tessel.comm.algorithms import _wait, exchange, group_ranks, restrict_nodes


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
