"""Hugging Face Mixtral's mixture of experts, as tessel sees it: where its experts are, and its aux loss.

transformers' MixtralSparseMoeBlock routes with its own MixtralTopKRouter (`gate`:
softmax over the experts, top-k, the k weights renormalised to sum to 1) and
hands (tokens, top-k ids, top-k weights) to MixtralExperts (`experts`: every
expert's gate/up projection stacked in gate_up_proj (E, 2F, C), its down
projection in down_proj (E, C, F)). Mixtral has no capacity: no token is ever
dropped. Expert parallelism (tessel.parallel.expert.hf_experts) replaces only
the `experts` module, under the same name and with the same parameter names, so
routing stays transformers' own and checkpoints keep transformers' names.

The load-balancing loss is transformers' load_balancing_loss_func (Switch's
E * sum_i f_i * P_i with f_i counting every top-k choice, f and P taken over the
tokens of all layers together), added with router_aux_loss_coef when the config
sets output_router_logits, as MixtralForCausalLM.forward does. tessel computes it
from the router logits of the latest training forward so that the statistics can
span the whole batch (tessel.models.moe.BalanceStatistics), and, under a pipeline,
every stage's layers (mixtral_statistics; tessel.parallel.expert.cross_stage).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn

from tessel.models.moe import BalanceStatistics, local_balance


def mixtral_modules(model: nn.Module, kind: str) -> list[tuple[str, nn.Module]]:
    """(name, module) of every Mixtral router (kind "router") or experts container (kind "experts")."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts, MixtralTopKRouter
    cls = {"router": MixtralTopKRouter, "experts": MixtralExperts}[kind]
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def mixtral_statistics(router_logits: list[torch.Tensor], n_experts: int, top_k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What load_balancing_loss_func sums over the rows of every layer given, (N, E) logits each: the top-k
    choices of each expert C (E,), the sum of each expert's router probabilities S (E,), differentiable, and
    the rows R (); its loss is E * sum(C * S) / R^2 (a pipeline stage's share: tessel.parallel.expert.cross_stage)."""
    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])  # (L*N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    counts = torch.bincount(chosen.reshape(-1), minlength=n_experts)
    return counts, probs.sum(0), torch.tensor(probs.size(0), device=probs.device)


def mixtral_balance_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int,
                         balance: BalanceStatistics = local_balance) -> torch.Tensor:
    """transformers' load_balancing_loss_func (attention_mask None) for the logits of every layer, (N, E) each:
    the fraction of top-k choices per expert f and the mean probability P over all layers' rows, E*sum f*P."""
    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])  # (L*N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    f, P = balance(torch.bincount(chosen.reshape(-1), minlength=n_experts), probs)
    return n_experts * (f * P).sum()


class MixtralRouterLoss:
    """router_aux_loss_coef * Mixtral's balance loss for the training forward that ran last (None before one)."""

    def __init__(self, model: nn.Module, coef: float, n_experts: int, top_k: int):
        self.coef, self.n_experts, self.top_k = coef, n_experts, top_k
        self.balance: BalanceStatistics = local_balance  # over which tokens f and P are taken
        self.logits: dict[str, torch.Tensor] = {}
        for name, router in mixtral_modules(model, "router"):
            router.register_forward_hook(self._recorder(name))

    def _recorder(self, name: str):
        def record(module: nn.Module, args, output) -> None:
            if torch.is_grad_enabled():  # training forwards only: the loss is added only there
                self.logits[name] = output[0]  # MixtralTopKRouter -> (logits, top-k weights, top-k ids)
        return record

    def take_logits(self) -> list[torch.Tensor]:
        """The router logits (N, E) of every layer in the latest training forward ([] if none ran since)."""
        logits, self.logits = list(self.logits.values()), {}
        return logits

    def __call__(self) -> torch.Tensor | None:
        logits = self.take_logits()
        if not logits:
            return None
        return self.coef * mixtral_balance_loss(logits, self.n_experts, self.top_k, self.balance)


def with_router_loss(loss_fn: Callable, router_loss: MixtralRouterLoss) -> Callable:
    """loss_fn(logits, targets) plus the router loss of the forward that made the logits (training only)."""

    def loss_with_router(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        if torch.is_grad_enabled():
            aux = router_loss()
            if aux is not None:
                loss = loss + aux
        return loss

    return loss_with_router


def mixtral_router_loss(model: nn.Module, hf_config: dict) -> MixtralRouterLoss | None:
    """The router loss a transformers Mixtral adds to its own loss; None where its config leaves it out."""
    if not hf_config.get("output_router_logits", False):
        return None
    return MixtralRouterLoss(model, float(hf_config.get("router_aux_loss_coef", 0.001)),
                             int(hf_config["num_local_experts"]), int(hf_config.get("num_experts_per_tok", 2)))
