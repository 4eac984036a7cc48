"""Expert parallelism: experts sharded over the mesh axis "ep", tokens moved by all-to-all.

Each rank of an ep group holds E/ep consecutive experts (rank j: experts
[j*E/ep, (j+1)*E/ep)). Every rank routes its own tokens (capacity is counted
per rank, GShard's "group"), then:

    dispatch: sort my kept assignments by expert -> exchange per-expert counts
              (all-to-all of E integers) -> all_to_all_single of the tokens with
              variable split sizes -> regroup what arrived by local expert
    experts:  each local expert runs on its contiguous rows
    combine:  undo the regrouping -> all_to_all_single back with the splits
              swapped -> undo the sort; MoE.forward weights by the gates

Routing decisions never leave the rank that made them, so the router, the
capacity cut and the aux loss are exactly those of a single device fed the same
rank-sized batch; only the expert matmuls happen elsewhere.

Composition with data parallelism: the experts of one ep coordinate are
replicated over dp; non-expert parameters over dp x ep. Expert weights are
marked sharded over ep, and tessel.parallel.data.data_parallel reduces each gradient over
the data axes that replicate it (see DataParallel).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.axes import TOKEN_AXES
from tessel.mesh import Mesh
from tessel.models.moe import MoE, Routing, moe_layers, sort_by_expert, weighted_scatter
from tessel.sharding import mark_sharded


def _all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
    return out


class AllToAll(torch.autograd.Function):
    """GShard's all-to-all (Lepikhin et al. 2020, Sec. 3.2, Algorithm 2), both of its uses: the dispatch
    (`dispatched_expert_inputs = AllToAll(...)`: rows go to the ranks that hold their experts) and the combine
    (`expert_outputs = AllToAll(...)`: expert outputs travel back to the ranks that own the tokens).
    in_splits[j] rows go to rank j, out_splits[j] rows arrive from rank j; the gradient is the same exchange
    with the splits swapped."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        return _all_to_all(x, out_splits, in_splits, group)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group), None, None, None


def block_shift(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """counts (A, B) of `rows` rows in blocks laid out A-major (a's blocks b = 0..B-1, then a + 1's) -> for
    each row of the B-major layout (b's blocks a = 0..A-1, then b + 1's), its index in the A-major one.
    Arithmetic on the block offsets, not a sort, and no host read (`rows` is known). With counts (source
    rank, local expert) it regroups the rows that arrived by source as rows by expert; with its transpose,
    back."""
    a_major = counts.reshape(-1)
    b_major = counts.t().reshape(-1)
    a_starts = (torch.cumsum(a_major, 0) - a_major).view(counts.shape).t().reshape(-1)  # in B-major order
    shift = a_starts - (torch.cumsum(b_major, 0) - b_major)  # (A*B,) each block's start there - here
    return torch.arange(rows, device=counts.device) + torch.repeat_interleave(shift, b_major, output_size=rows)


class AllToAllDispatcher:
    """Same interface as tessel.models.moe.LocalDispatcher, for experts sharded over ep.

    The dispatch at the floor of its collective: one sort of the assignments by expert (whose order the
    all-to-all needs: rows bound for rank j are contiguous), one small all-to-all of the per-expert counts
    (the split sizes, both ways, for the dispatch and the combine), one host read of the split sizes (the
    collective takes them as lists), and, with more than one local expert, one gather by an index computed
    from the counts (block_shift), no per-expert loop."""

    def __init__(self, n_experts: int, group, ep: int):
        self.n_experts, self.group, self.ep = n_experts, group, ep
        self.local = n_experts // ep

    def dispatch(self, x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor, object]:
        # x: (N, C) my tokens; rows bound for rank j are contiguous once sorted by global expert id
        rows, s = sort_by_expert(x, r, self.n_experts)  # (M, C), s.counts (E,) rows I send per expert
        recv = torch.empty_like(s.counts)  # (ep*El,) rows each source sends to each of my experts
        dist.all_to_all_single(recv, s.counts, group=self.group)  # counts first: they are the splits
        recv_counts = recv.view(self.ep, self.local)  # (source rank, local expert)
        splits = torch.cat([s.counts.view(self.ep, self.local).sum(1), recv_counts.sum(1)]).tolist()  # one read
        send_splits, recv_splits = splits[:self.ep], splits[self.ep:]
        arrived = AllToAll.apply(rows, recv_splits, send_splits, self.group)
        regroup = None
        if self.local > 1:  # arrived rows are ordered (source, expert): regroup as (expert, source), and back
            rows_in = sum(recv_splits)
            regroup = (block_shift(recv_counts, rows_in), block_shift(recv_counts.t(), rows_in))
            arrived = arrived.index_select(0, regroup[0])
        return arrived, recv_counts.sum(0), (s, regroup, send_splits, recv_splits)

    def combine(self, y: torch.Tensor, state: object) -> torch.Tensor:
        s, regroup, send_splits, recv_splits = state
        if regroup is not None:
            y = y.index_select(0, regroup[1])  # back to (source, expert) order
        back = AllToAll.apply(y, send_splits, recv_splits, self.group)  # (M, C), my sorted rows
        return weighted_scatter(back, s)  # (N, C)


def shard_experts(model: nn.Module, mesh: Mesh) -> list[MoE]:
    """Keep this rank's experts in every MoE layer and give it an all-to-all dispatcher."""
    ep, j = mesh.size("ep"), mesh.coord("ep")
    layers = moe_layers(model)
    for moe in layers:
        local = moe.n_experts // ep
        for lin in (moe.experts.w_gate, moe.experts.w_up, moe.experts.w_down):
            shard = nn.Parameter(lin.weight.detach()[j * local:(j + 1) * local].clone(),
                                 requires_grad=lin.weight.requires_grad)
            mark_sharded(shard, "ep", dim=0)
            lin.weight = shard
        moe.dispatcher = AllToAllDispatcher(moe.n_experts, mesh.group("ep"), ep)
    return layers


def moe_metrics(layers: list[MoE], mesh: Mesh) -> dict[str, float]:
    """Per-expert load, drop rate and aux losses of the last step, summed over the data shards.

    Keys: moe/load/L{i}/e{j} (share of the i-th MoE layer's assignments that chose
    expert j, before capacity), moe/load_max_min (worst max/min load ratio over layers;
    min counted as at least one token), moe/drop_rate, moe/aux_loss and
    moe/z_loss (per forward, summed over layers, averaged over shards).
    Collective over (dp, ep, cp): every rank of the group must call it (cp ranks hold chunks of the same
    sequences: their loads and drops add up to the whole sequences').
    """
    if not layers:
        return {}
    stats = [m.pop_stats() for m in layers]
    if not stats[0]:
        return {}
    E = layers[0].n_experts
    # one vector: per layer [load (E), dropped, aux, z, forwards]
    flat = torch.cat([torch.cat([s["load"], torch.stack([s["dropped"], s["aux_loss"], s["z_loss"], s["forwards"]])])
                      for s in stats]).to(mesh.device)
    group = mesh.group(*TOKEN_AXES)
    if group is not None:
        dist.all_reduce(flat, group=group)
    per = flat.view(len(layers), E + 4).cpu()
    load, dropped, aux, z, fwd = per[:, :E], per[:, E], per[:, E + 1], per[:, E + 2], per[:, E + 3]
    out: dict[str, float] = {}
    share = load / load.sum(1, keepdim=True).clamp_min(1)
    for i in range(len(layers)):
        for e in range(E):
            out[f"moe/load/L{i}/e{e}"] = share[i, e].item()
    out["moe/load_max_min"] = (load.max(1).values / load.min(1).values.clamp_min(1)).max().item()
    out["moe/drop_rate"] = (dropped.sum() / load.sum().clamp_min(1)).item()
    out["moe/aux_loss"] = (aux / fwd).sum().item()
    out["moe/z_loss"] = (z / fwd).sum().item()
    return out
