"""Expert parallelism for Hugging Face MoE families: their own experts, fed by tessel's all-to-all dispatcher.

transformers' MoE blocks (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek-V2/V3, GLM-4-MoE, PhiMoE, GraniteMoE,
GPT-OSS, ...) route with their own router (softmax or sigmoid, top-k, renormalised or scaled, DeepSeek's
biased group-limited choice) and hand the experts module (tessel.hf.ep_plan: the one the family's
base_model_ep_plan names) the tokens (N, C), the chosen global expert ids (N, k) and their weights (N, k).
Under ep that module stays in its place, with its own class, forward and parameter names; it keeps only this
rank's E/ep experts (rows [j*E/ep, (j+1)*E/ep) of every per-expert parameter, marked sharded over ep so that
data parallelism reduces them over dp alone, and checkpoints and export save the logical (E, ...) tensors),
and its forward is wrapped, as transformers' own expert parallelism wraps it:

    routing -> AllToAllDispatcher.dispatch (the reference GPT's MoE uses the same) -> the module's own forward
    on the rows that arrived, with local expert ids and weight 1 -> combine, weighted by the router's weights

so the experts compute exactly the family's expert MLP (gated or not, biases, GPT-OSS's clamped SwiGLU,
transposed layouts) and the routing is the family's, run on every rank's own tokens. Shared experts and first
dense layers are not in the plan: they stay whole, like the attention. Nothing is dropped (these families
have no capacity factor): every top-k choice reaches its expert.

The router loss of the family (tessel.models.hf.moe.RouterLoss) joins the loss function (under a pipeline,
each stage adds its share: tessel.parallel.expert.cross_stage); with model.aux_loss_scope = "global" its
statistics span the ranks that split the batch, so any layout trains on transformers' single-process loss.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn as nn

from tessel.hf.ep_plan import ExpertSite, ep_problem, expert_sites
from tessel.mesh import Mesh
from tessel.models.moe import Routing
from tessel.parallel.expert.expert_parallel import AllToAllDispatcher
from tessel.sharding import mark_sharded


def routing_of(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, n_experts: int) -> Routing:
    """The family's choices (N, k) as tessel's Routing: every assignment kept (no capacity, nothing dropped)."""
    N, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    zero = top_k_weights.new_zeros(())
    return Routing(token=torch.arange(N, device=expert.device).repeat_interleave(k), expert=expert,
                   gate=top_k_weights.reshape(-1), load=torch.bincount(expert, minlength=n_experts),
                   dropped=torch.zeros((), dtype=torch.long, device=expert.device), aux_loss=zero, z_loss=zero)


class ExpertParallelForward:
    """An experts module's own forward, run on the rows this rank's experts receive from every ep rank.

    Called as the module is: (hidden_states (N, C), global expert ids (N, k), weights (N, k)), by position or
    by the family's own argument names; returns the weighted sum over each token's experts (N, C)."""

    def __init__(self, experts: nn.Module, n_experts: int, dispatcher: AllToAllDispatcher):
        self.forward = experts.forward  # the family's own, bound to the module that now holds E/ep experts
        self.signature = inspect.signature(self.forward)
        self.n_experts, self.dispatcher = n_experts, dispatcher

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        hidden_states, top_k_index, top_k_weights = self.signature.bind(*args, **kwargs).arguments.values()
        r = routing_of(top_k_index, top_k_weights, self.n_experts)
        rows, counts, state = self.dispatcher.dispatch(hidden_states, r)  # (M, C) grouped by local expert
        out = self.dispatcher.combine(self._local_experts(rows, counts), state)  # (N, C), weighted by the gates
        return out.to(hidden_states.dtype)

    def _local_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The module's forward on the rows that arrived: local ids by their group, weight 1 (the combine weighs)."""
        if not rows.size(0):
            # no row came: one zero row (still on the graph) runs expert 0, so that every rank's experts get
            # a gradient (zero) and the collectives of the backward stay matched
            return self.forward(rows.sum(0, keepdim=True), *_local_ids([1], rows))[:0]
        return self.forward(rows, *_local_ids(counts, rows))


def _local_ids(counts: torch.Tensor | list[int], rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows grouped by local expert as the module's arguments: top-1 choices (M, 1) of local ids, weight 1."""
    local = torch.arange(len(counts), device=rows.device)
    local = local.repeat_interleave(torch.as_tensor(counts, device=rows.device))
    return local[:, None], torch.ones(local.numel(), 1, dtype=rows.dtype, device=rows.device)


def shard_hf_experts(model: nn.Module, mesh: Mesh) -> list[ExpertSite]:
    """Keep this rank's E/ep experts in every experts module of the model's ep plan, fed by all-to-all over
    ep. ValueError naming the module (tessel.config refuses the same before any process starts)."""
    ep = mesh.size("ep")
    why = ep_problem(model, ep)
    if why is not None:
        raise ValueError(why)
    sites = expert_sites(model)
    for site in sites:
        local, first = site.n_experts // ep, mesh.coord("ep") * (site.n_experts // ep)
        for name in site.params:
            owner, _, attr = f"{site.name}.{name}".rpartition(".")
            holder = model.get_submodule(owner)
            setattr(holder, attr, _shard(getattr(holder, attr), first, local))
        dispatcher = AllToAllDispatcher(site.n_experts, mesh.group("ep"), ep)
        site.module.forward = ExpertParallelForward(site.module, site.n_experts, dispatcher)
        site.module.num_experts = local  # its forward counts the experts it holds (as transformers' ep sets it)
    return sites


def _shard(weight: nn.Parameter, start: int, n: int) -> nn.Parameter:
    shard = nn.Parameter(weight.detach()[start:start + n].clone(), requires_grad=weight.requires_grad)
    mark_sharded(shard, "ep", dim=0)
    return shard
