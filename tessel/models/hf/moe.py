"""Hugging Face mixtures of experts as tessel sees them: the router loss every family adds.

The router loss. transformers' MoE causal LMs (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, GraniteMoE, JetMoE,
DBRX, GPT-OSS, ...) add the same load-balancing loss when their config sets output_router_logits: each family's
own copy of load_balancing_loss_func (Switch's E * sum_i f_i * P_i, f_i counting every top-k choice of expert i,
P_i its mean router probability, both taken over the rows of all layers together) on the router logits its model
records (`can_record_outputs["router_logits"]`: which modules, which element of their output), with the causal
LM's own num_experts, num_experts_per_tok and router_aux_loss_coef. tessel records the same logits from the same
modules during the latest training forward and computes that loss itself, so that its statistics can span the
whole batch (tessel.models.moe.BalanceStatistics; aux_loss_scope) and, under a pipeline, every stage's layers
(balance_statistics; tessel.parallel.expert.cross_stage). A family whose forward adds no such loss (DeepSeek-V3
balances its experts by a bias) gets none; one whose loss differs is refused before any process
(tessel.hf.check).

The experts. Every family's MoE block routes with its own router and hands its experts module (the one its
base_model_ep_plan names) the tokens, the chosen expert ids and their weights; expert parallelism
(tessel.parallel.expert.hf_experts, tessel.hf.ep_plan) keeps that module, its class and its parameter names,
and feeds it the rows of this rank's experts, so routing stays transformers' own and checkpoints keep
transformers' names.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from tessel.hf.check import balance_loss_of, is_standard_balance_loss
from tessel.models.moe import BalanceStatistics, local_balance


@dataclass(frozen=True)
class RouterLossSpec:
    """What the family's causal LM passes to its load_balancing_loss_func, and the coefficient it adds it with."""
    coef: float
    n_experts: int
    top_k: int


def router_loss_spec(model: nn.Module) -> RouterLossSpec | None:
    """The router loss the transformers model adds to its own loss; None where it adds none (output_router_logits
    off, or a family without a load-balancing loss). ValueError naming what tessel cannot reproduce."""
    if not getattr(model.config, "output_router_logits", False):
        return None
    loss = balance_loss_of(type(model))
    if loss is None:
        return None
    name = type(model).__name__
    if not is_standard_balance_loss(loss):
        raise ValueError(f"{name}'s load-balancing loss is not the one tessel computes; set output_router_logits "
                         "to false")
    # every family's causal LM keeps them as attributes (JetMoE calls its coefficient aux_loss_coef)
    coef = getattr(model, "router_aux_loss_coef", getattr(model, "aux_loss_coef", None))
    values = {"router_aux_loss_coef": coef, "num_experts": getattr(model, "num_experts", None),
              "num_experts_per_tok": getattr(model, "num_experts_per_tok", None)}
    missing = [key for key, value in values.items() if value is None]
    if missing:
        raise ValueError(f"{name} adds a load-balancing loss but has no {', '.join(missing)}: tessel cannot "
                         "reproduce it; set output_router_logits to false")
    return RouterLossSpec(float(coef), int(values["num_experts"]), int(values["num_experts_per_tok"]))


def router_outputs(model: nn.Module) -> list[tuple[str, nn.Module, int]]:
    """(name, module, index) of every module whose output (its element `index` when a tuple) the model records as
    router logits, by its `can_record_outputs` (transformers.utils.output_capturing's rules: a class, a class
    name ending the module's name, or an OutputRecorder with an index and a layer name; a bare class records
    element 1)."""
    from transformers.utils.output_capturing import OutputRecorder
    specs = model.can_record_outputs.get("router_logits", [])
    specs = [s if isinstance(s, OutputRecorder) else
             OutputRecorder(target_class=None if isinstance(s, str) else s, index=1,
                            class_name=s if isinstance(s, str) else None)
             for s in (specs if isinstance(specs, list) else [specs])]
    found = []
    for name, module in model.named_modules():
        for s in specs:
            matches = ((s.target_class is not None and isinstance(module, s.target_class))
                       or (s.class_name is not None and name.endswith(s.class_name)))
            if matches and (s.layer_name is None or f".{s.layer_name.strip('.')}." in f".{name}."):
                found.append((name, module, s.index))
    return found


def balance_statistics(router_logits: list[torch.Tensor], n_experts: int, top_k: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What load_balancing_loss_func sums over the rows of every layer given, (N, E) logits each: the top-k
    choices of each expert C (E,), the sum of each expert's router probabilities S (E,), differentiable, and
    the rows R (); its loss is E * sum(C * S) / R^2 (a pipeline stage's share: tessel.parallel.expert.cross_stage)."""
    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])  # (L*N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    counts = torch.bincount(chosen.reshape(-1), minlength=n_experts)
    return counts, probs.sum(0), torch.tensor(probs.size(0), device=probs.device)


def balance_loss(router_logits: list[torch.Tensor], n_experts: int, top_k: int,
                 balance: BalanceStatistics = local_balance) -> torch.Tensor:
    """transformers' load_balancing_loss_func (attention_mask None) for the logits of every layer, (N, E) each:
    the fraction of top-k choices per expert f and the mean probability P over all layers' rows, E*sum f*P."""
    probs = torch.cat([logits.float().softmax(-1) for logits in router_logits])  # (L*N, E)
    chosen = probs.topk(top_k, dim=-1).indices  # (L*N, k)
    f, P = balance(torch.bincount(chosen.reshape(-1), minlength=n_experts), probs)
    return n_experts * (f * P).sum()


class RouterLoss:
    """coef * the family's balance loss for the training forward that ran last (None before one)."""

    def __init__(self, model: nn.Module, spec: RouterLossSpec):
        self.coef, self.n_experts, self.top_k = spec.coef, spec.n_experts, spec.top_k
        self.balance: BalanceStatistics = local_balance  # over which tokens f and P are taken
        self.logits: dict[str, torch.Tensor] = {}
        for name, module, index in router_outputs(model):
            module.register_forward_hook(self._recorder(name, index))

    def _recorder(self, name: str, index: int):
        def record(module: nn.Module, args, output) -> None:
            if torch.is_grad_enabled():  # training forwards only: the loss is added only there
                self.logits[name] = output[index] if isinstance(output, tuple) else output
        return record

    def take_logits(self) -> list[torch.Tensor]:
        """The router logits (N, E) of every layer in the latest training forward ([] if none ran since)."""
        logits, self.logits = list(self.logits.values()), {}
        return logits

    def __call__(self) -> torch.Tensor | None:
        logits = self.take_logits()
        if not logits:
            return None
        return self.coef * balance_loss(logits, self.n_experts, self.top_k, self.balance)


def with_router_loss(loss_fn: Callable, router_loss: RouterLoss) -> Callable:
    """loss_fn(logits, targets) plus the router loss of the forward that made the logits (training only)."""

    def loss_with_router(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        if torch.is_grad_enabled():
            aux = router_loss()
            if aux is not None:
                loss = loss + aux
        return loss

    return loss_with_router


def router_loss(model: nn.Module) -> RouterLoss | None:
    """The router loss the transformers model adds to its own loss, recorded from its routers; None where its
    config or its family leaves it out."""
    spec = router_loss_spec(model)
    return None if spec is None else RouterLoss(model, spec)
