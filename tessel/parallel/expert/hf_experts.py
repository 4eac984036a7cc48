"""Expert parallelism for Hugging Face Mixtral: its experts on tessel's all-to-all dispatcher.

Each MixtralSparseMoeBlock keeps its router (transformers' own softmax -> top-k ->
renormalised weights) and calls `self.experts(hidden, top_k_index, top_k_weights)`.
ShardedMixtralExperts takes that place: the same call, the same parameter names
(`...mlp.experts.gate_up_proj`, `...mlp.experts.down_proj`), holding only this
rank's E/ep experts (rows [j*E/ep, (j+1)*E/ep) of dim 0, marked sharded over ep so
that data parallelism reduces them over dp alone, and checkpoints and export save
the logical (E, ...) tensors). Tokens travel by tessel.parallel.expert's
AllToAllDispatcher, the one the reference GPT's MoE uses. Mixtral has no capacity
factor, so nothing is dropped: every top-k choice reaches its expert.

The load-balancing loss (tessel.models.hf.moe.RouterLoss) joins the loss
function (under a pipeline, each stage adds its share: tessel.parallel.expert.cross_stage);
with model.aux_loss_scope = "global" its statistics span the ranks that split the
batch, so any layout trains on transformers' single-process loss.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.models.hf.moe import mixtral_modules
from tessel.models.moe import Routing
from tessel.parallel.expert.expert_parallel import AllToAllDispatcher
from tessel.sharding import mark_sharded


def mixtral_routing(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int) -> Routing:
    """Mixtral's choices (N, k) as tessel's Routing: every assignment kept (no capacity, nothing dropped)."""
    N, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    zero = top_k_weights.new_zeros(())
    return Routing(token=torch.arange(N, device=expert.device).repeat_interleave(k), expert=expert,
                   gate=top_k_weights.reshape(-1), load=torch.bincount(expert, minlength=n_experts),
                   dropped=torch.zeros((), dtype=torch.long, device=expert.device), aux_loss=zero, z_loss=zero)


class ShardedMixtralExperts(nn.Module):
    """MixtralExperts' place and parameter names, this rank's experts only; tokens moved by all-to-all."""

    def __init__(self, experts: nn.Module, mesh: Mesh):
        super().__init__()
        ep, j = mesh.size("ep"), mesh.coord("ep")
        self.n_experts = experts.num_experts
        local = self.n_experts // ep
        self.gate_up_proj = _shard(experts.gate_up_proj, j * local, local)  # (E/ep, 2F, C)
        self.down_proj = _shard(experts.down_proj, j * local, local)  # (E/ep, C, F)
        self.act_fn = experts.act_fn
        self.dispatcher = AllToAllDispatcher(self.n_experts, mesh.group("ep"), ep)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        # hidden_states (N, C); top_k_index, top_k_weights (N, k) from Mixtral's router
        r = mixtral_routing(top_k_index, top_k_weights, self.n_experts)
        rows, counts, state = self.dispatcher.dispatch(hidden_states, r)  # (M, C) grouped by local expert
        out = self.dispatcher.combine(self._experts(rows, counts), state)  # (N, C), weighted by the gates
        return out.to(hidden_states.dtype)

    def _experts(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Each local expert on its rows: down(act(gate) * up), Mixtral's expert MLP."""
        outs = []
        for e, chunk in enumerate(x.split(counts)):
            gate, up = nn.functional.linear(chunk, self.gate_up_proj[e]).chunk(2, dim=-1)
            outs.append(nn.functional.linear(self.act_fn(gate) * up, self.down_proj[e]))
        return torch.cat(outs) if outs else x[:0]


def _shard(weight: nn.Parameter, start: int, n: int) -> nn.Parameter:
    shard = nn.Parameter(weight.detach()[start:start + n].clone(), requires_grad=weight.requires_grad)
    mark_sharded(shard, "ep", dim=0)
    return shard


def shard_mixtral_experts(model: nn.Module, mesh: Mesh) -> int:
    """Swap every MixtralExperts for this rank's ShardedMixtralExperts; returns how many were swapped."""
    swapped = mixtral_modules(model, "experts")
    for name, experts in swapped:
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent), child, ShardedMixtralExperts(experts, mesh))
    return len(swapped)
