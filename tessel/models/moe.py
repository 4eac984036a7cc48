"""Mixture-of-experts feed-forward block: Switch (top-1) and GShard (top-2) routing.

A token's hidden state goes to the k experts its router scores highest; each
expert is a SwiGLU MLP, and the token's output is the gate-weighted sum of its
experts' outputs. Each expert takes at most `capacity` tokens from one forward
call (GShard's "group"); tokens past that are dropped and leave the block as
zeros, so only the residual carries them on.

    x (B, T, C) -> router -> Routing (which token goes to which expert, gate)
                -> dispatcher.dispatch -> token rows grouped by local expert
                -> experts -> dispatcher.combine -> gate-weighted sum at each
                   token's place (B, T, C); dropped tokens get zeros

The dispatcher is the seam for expert parallelism: LocalDispatcher (here)
keeps every expert on this device; tessel.parallel.expert.expert_parallel swaps in one that
moves tokens to the experts' ranks by all-to-all. The router's `balance` (over which
tokens f and P are taken) and `slots` (over which tokens capacity is counted) are
the seams for the statistics' scope: tessel.parallel.expert.balance widens the first
to the whole batch, tessel.parallel.context.moe both to the whole sequences that
context parallelism splits. This file stays single-device.

References: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020,
"GShard" (top-2, capacity, random routing, Algorithm 1); Fedus et al. 2021,
"Switch Transformers" (top-1, aux loss alpha*E*sum f_i*P_i, router jitter,
router in fp32); Zoph et al. 2022, "ST-MoE" (router z-loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F

from tessel.config import ModelConfig


def capacity(n_tokens: int, n_experts: int, factor: float) -> int:
    """Slots per expert for one forward call: ceil(tokens / E * capacity_factor).

    Counted in tokens, not assignments, for top-1 and top-2 alike: GShard's top-2
    capacity of 2N/E is capacity_factor = 2."""
    return math.ceil(n_tokens / n_experts * factor)


@dataclass
class Routing:
    """The router's decision for N tokens, as M kept (token, expert, gate) assignments."""
    token: torch.Tensor   # (M,) index of the token in the flattened input
    expert: torch.Tensor  # (M,) global expert id
    gate: torch.Tensor    # (M,) combine weight (differentiable)
    load: torch.Tensor    # (E,) assignments per expert before the capacity cut
    dropped: torch.Tensor  # () assignments cut by capacity (skipped random second choices do not count)
    aux_loss: torch.Tensor  # () alpha*E*sum f_i*P_i
    z_loss: torch.Tensor    # () coef*mean(logsumexp(logits)^2)


def top_k_gates(probs: torch.Tensor, k: int, random_second: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (N, E) -> gates (N, k), experts (N, k).

    Top-2 renormalises the two gates to sum to 1 (GShard). With random routing
    the second expert is kept only with probability 2*g2 (g2 <= 1/2 after
    renormalising), sparing compute for tokens that barely want it; a skipped
    second choice gets gate 0 and expert -1.
    """
    gates, experts = probs.topk(k, dim=-1)
    if k == 2:
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).tiny)
        if random_second:
            skip = 2 * gates[:, 1].detach() < torch.rand_like(gates[:, 1])
            experts = torch.stack([experts[:, 0], experts[:, 1].masked_fill(skip, -1)], dim=1)
            gates = torch.stack([gates[:, 0], gates[:, 1].masked_fill(skip, 0.0)], dim=1)
    return gates, experts


def assign_slots(experts: torch.Tensor, n_experts: int, cap: int) -> tuple[torch.Tensor, torch.Tensor]:
    """experts (N, k) -> (keep (N, k) bool, position (N, k) in the chosen expert's buffer).

    Slots are handed out in priority order: every token's first choice before
    any second choice (GShard Algorithm 1), and by token order within a choice.
    Experts of -1 (skipped by random routing) take no slot.
    """
    N, k = experts.shape
    flat = experts.t().reshape(-1)  # (k*N,) choice-major: all first choices, then all second
    valid = flat >= 0
    onehot = F.one_hot(flat.clamp_min(0), n_experts) * valid[:, None]  # (k*N, E)
    position = (onehot.cumsum(0) - 1).gather(1, flat.clamp_min(0)[:, None]).squeeze(1)
    keep = valid & (position < cap)
    return keep.view(k, N).t(), position.view(k, N).t()


class SlotAssignment(Protocol):
    """Which of the router's assignments keep a slot: experts (N, k) of `batch` equal rows of tokens (the
    flattened (B, T) of one forward call) -> keep (N, k) bool. The scope of the capacity is the
    implementation's: this device's tokens (local_slots), or whole sequences whose chunks other ranks hold
    (tessel.parallel.context.moe.SequenceSlots, under context parallelism)."""

    def __call__(self, experts: torch.Tensor, n_experts: int, factor: float, batch: int) -> torch.Tensor: ...


def local_slots(experts: torch.Tensor, n_experts: int, factor: float, batch: int = 1) -> torch.Tensor:
    """GShard's group is this forward call's N tokens: capacity(N) slots an expert, handed out by assign_slots."""
    keep, _ = assign_slots(experts, n_experts, capacity(experts.size(0), n_experts, factor))
    return keep


class BalanceStatistics(Protocol):
    """Turns the router's own tokens into the load-balancing statistics (f, P), each (E,).

    counts (E,): tokens whose first choice is each expert; probs (N, E): router probabilities.
    The scope of the batch they describe is the implementation's: this device's tokens
    (local_balance), or the tokens of every rank that splits the batch
    (tessel.parallel.expert.balance.GlobalBalance, Qiu et al. 2025)."""

    def __call__(self, counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


def local_balance(counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """f_i: fraction of this call's tokens whose first choice is i; P_i: their mean probability of i."""
    return counts.to(probs.dtype) / probs.size(0), probs.mean(0)


def load_balancing_loss(probs: torch.Tensor, first_choice: torch.Tensor, coef: float,
                        balance: BalanceStatistics = local_balance) -> torch.Tensor:
    """Switch's aux loss alpha*E*sum_i f_i*P_i; f_i: fraction of tokens whose first choice is i,
    P_i: mean router probability of i. Equals alpha under uniform routing (f_i = P_i = 1/E)."""
    E = probs.size(-1)
    f, P = balance(torch.bincount(first_choice, minlength=E), probs)
    return coef * E * (f * P).sum()


class Router(nn.Module):
    """Linear scores -> softmax -> top-k -> capacity. Computed in fp32 (Switch: bf16 routing is unstable)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.init_std)
        self.n_experts, self.k = cfg.n_experts, cfg.moe_top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.jitter, self.random_second = cfg.router_jitter, cfg.moe_random_routing
        # over which tokens f and P are taken; expert/data parallelism may widen it to the whole batch
        self.balance: BalanceStatistics = local_balance
        # over which tokens capacity is counted; context parallelism widens it to the whole sequences
        self.slots: SlotAssignment = local_slots

    def forward(self, x: torch.Tensor, batch: int = 1) -> Routing:
        # x: (N, C) flattened tokens, `batch` rows of N/batch
        x = x.float()
        training = self.training and torch.is_grad_enabled()
        if training and self.jitter > 0:  # multiplicative noise on the router input (Switch)
            x = x * torch.empty_like(x).uniform_(1 - self.jitter, 1 + self.jitter)
        with torch.autocast(x.device.type, enabled=False):
            logits = F.linear(x, self.weight.float())  # (N, E)
        return self.route(logits, random_second=training and self.random_second, batch=batch)

    def route(self, logits: torch.Tensor, random_second: bool = False, batch: int = 1) -> Routing:
        """From router logits (N, E) to kept assignments; separate so tests can hand-make logits."""
        N, E = logits.shape
        probs = logits.softmax(-1)
        gates, experts = top_k_gates(probs, self.k, random_second)  # (N, k)
        keep = self.slots(experts, E, self.capacity_factor, batch)
        chosen = experts[experts >= 0]
        load = torch.bincount(chosen, minlength=E)
        token = torch.arange(N, device=logits.device)[:, None].expand(N, self.k)
        aux = load_balancing_loss(probs, experts[:, 0], self.aux_coef, self.balance)
        z = self.z_coef * logits.logsumexp(-1).pow(2).mean()
        return Routing(token=token[keep], expert=experts[keep], gate=gates[keep], load=load,
                       dropped=chosen.numel() - keep.sum(), aux_loss=aux, z_loss=z)


@dataclass
class Sorted:
    """Kept assignments sorted by expert: what a dispatcher needs to send rows and bring them home."""
    token: torch.Tensor   # (M,) token of each sorted assignment
    gate: torch.Tensor    # (M,)
    counts: torch.Tensor  # (E,) assignments per expert
    n_tokens: int


def sort_by_expert(x: torch.Tensor, r: Routing, n_experts: int) -> tuple[torch.Tensor, Sorted]:
    """x (N, C) -> the rows of the kept assignments, grouped by expert (M, C), and their bookkeeping.
    index_select rather than x[idx]: one gather, and far faster on CPU."""
    order = torch.argsort(r.expert, stable=True)
    token = r.token.index_select(0, order)
    counts = torch.bincount(r.expert, minlength=n_experts)
    return x.index_select(0, token), Sorted(token, r.gate.index_select(0, order), counts, x.size(0))


def weighted_scatter(y: torch.Tensor, s: Sorted) -> torch.Tensor:
    """Expert outputs (M, C) in sorted order -> (N, C): each token gets the gate-weighted sum of its
    experts' outputs (GShard's combine), straight into its own row; dropped tokens stay 0."""
    out = torch.zeros(s.n_tokens, y.size(1), dtype=y.dtype, device=y.device)
    return out.index_add(0, s.token, y * s.gate[:, None].to(y.dtype))


class LocalDispatcher:
    """Every expert lives here: group token rows by expert, and bring them back. No communication."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts

    def dispatch(self, x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, list[int], object]:
        """x (N, C) -> rows grouped by local expert (M, C), rows per local expert, state for combine."""
        rows, s = sort_by_expert(x, r, self.n_experts)
        return rows, s.counts.tolist(), s

    def combine(self, y: torch.Tensor, state: object) -> torch.Tensor:
        """Expert outputs (M, C) in dispatch order -> gate-weighted output per token (N, C)."""
        return weighted_scatter(y, state)


class ExpertLinear(nn.Module):
    """E bias-free linear maps stacked in one weight (E, out, in): experts shard along dim 0."""

    def __init__(self, n_experts: int, d_in: int, d_out: int, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in))
        nn.init.normal_(self.weight, std=std)


class Experts(nn.Module):
    """E SwiGLU MLPs (or this rank's share of them) applied to tokens grouped by expert."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, std: float):
        super().__init__()
        self.w_gate = ExpertLinear(n_experts, d_model, d_ff, std)
        self.w_up = ExpertLinear(n_experts, d_model, d_ff, std)
        self.w_down = ExpertLinear(n_experts, d_ff, d_model, std)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        # x: (M, C), rows grouped by local expert, counts[e] rows for expert e
        outs = []
        for e, chunk in enumerate(x.split(counts)):
            h = F.silu(chunk @ self.w_gate.weight[e].t()) * (chunk @ self.w_up.weight[e].t())  # (n_e, d_ff)
            outs.append(h @ self.w_down.weight[e].t())  # (n_e, C)
        return torch.cat(outs) if outs else x[:0]


class MoE(nn.Module):
    """Drop-in for the SwiGLU MLP of a Block. After each forward, `aux_loss` holds the
    router's auxiliary losses (load balance + z-loss) for the training loss to add."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.ffn_dim, cfg.init_std)
        self.dispatcher = LocalDispatcher(cfg.n_experts)
        self.n_experts = cfg.n_experts
        self.aux_loss: torch.Tensor | None = None
        self._stats: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        flat = x.reshape(B * T, C)
        r = self.router(flat, B)
        rows, counts, state = self.dispatcher.dispatch(flat, r)  # (M, C) grouped by local expert
        out = self.dispatcher.combine(self.experts(rows, counts), state)  # (B*T, C)
        self.aux_loss = r.aux_loss + r.z_loss
        if torch.is_grad_enabled():  # training forwards only: evaluation and sampling do not count
            self._record(r)
        return out.view(B, T, C).to(x.dtype)

    def _record(self, r: Routing) -> None:
        new = {"load": r.load.detach().double(), "dropped": r.dropped.detach().double(),
               "aux_loss": r.aux_loss.detach().double(), "z_loss": r.z_loss.detach().double(),
               "forwards": torch.ones((), dtype=torch.float64, device=r.load.device)}
        for key, value in new.items():
            self._stats[key] = self._stats[key] + value if key in self._stats else value

    def pop_stats(self) -> dict[str, torch.Tensor]:
        """Routing statistics summed over the training forwards since the last call."""
        stats, self._stats = self._stats, {}
        return stats


def moe_layers(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def with_aux_losses(loss_fn, model: nn.Module):
    """Wrap loss_fn(logits, targets) to add every MoE layer's auxiliary loss of the forward
    that made `logits`. Only while gradients are taken: validation reports plain cross-entropy."""
    layers = moe_layers(model)

    def loss_with_aux(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(logits, targets)
        if torch.is_grad_enabled():
            for m in layers:
                if m.aux_loss is not None:
                    loss = loss + m.aux_loss
        return loss

    return loss_with_aux
