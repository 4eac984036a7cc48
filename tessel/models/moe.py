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


def top_k_gates(probs: torch.Tensor, k: int, random_second: bool = False, normalise: bool | None = None,
                choice: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """probs (N, E) -> gates (N, k), experts (N, k).

    The k experts are those `choice` (N, E) ranks highest: probs themselves, or (DeepSeek-V3) probs plus a
    balancing bias, with the experts of a token's unchosen groups at -inf; the gates are always the probs.
    With `normalise` (default: k > 1) the k gates are divided by their sum (GShard's top-2, DeepSeek-V3).
    With random routing (top-2) the second expert is kept only with probability 2*g2 (g2 <= 1/2 after
    renormalising), sparing compute for tokens that barely want it; a skipped second choice gets gate 0
    and expert -1.
    """
    experts = (probs if choice is None else choice).topk(k, dim=-1).indices
    gates = probs.gather(-1, experts)  # the very values topk returns when choice is probs
    normalise = k > 1 if normalise is None else normalise
    if normalise:
        gates = gates / gates.sum(-1, keepdim=True).clamp_min(torch.finfo(gates.dtype).tiny)
    if k == 2 and random_second:
        skip = 2 * gates[:, 1].detach() < torch.rand_like(gates[:, 1])
        experts = torch.stack([experts[:, 0], experts[:, 1].masked_fill(skip, -1)], dim=1)
        gates = torch.stack([gates[:, 0], gates[:, 1].masked_fill(skip, 0.0)], dim=1)
    return gates, experts


def affinity(logits: torch.Tensor, score: str) -> torch.Tensor:
    """Router logits (N, E) -> each token's affinity for each expert: a softmax over the experts (Switch,
    GShard), or each expert's own sigmoid (DeepSeek-V3: experts do not compete for a token's mass)."""
    return logits.softmax(-1) if score == "softmax" else logits.sigmoid()


def limit_to_groups(choice: torch.Tensor, groups: int, limit: int) -> torch.Tensor:
    """Group-limited routing (DeepSeek-V2's device-limited, V3's node-limited): choice (N, E), experts in
    `groups` groups of consecutive ids -> choice with -inf outside each token's best `limit` groups, a
    group scored by the sum of its two highest choices (DeepSeek-V3's reference code)."""
    N, E = choice.shape
    per_group = choice.view(N, groups, E // groups)
    group_score = per_group.topk(min(2, E // groups), dim=-1).values.sum(-1)  # (N, G)
    best = group_score.topk(limit, dim=-1).indices  # (N, limit)
    allowed = torch.zeros(N, groups, dtype=torch.bool, device=choice.device).scatter_(1, best, True)
    return per_group.masked_fill(~allowed[:, :, None], float("-inf")).view(N, E)


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
    """Linear scores -> affinities -> top-k -> capacity. Computed in fp32 (Switch: bf16 routing is unstable).

    With balance = "bias" (DeepSeek-V3's auxiliary-loss-free balancing) a per-expert bias, a buffer that
    checkpoints carry, is added to the affinities for the choice of experts only (the gates stay the
    affinities); the training forwards add up each expert's load until `update_bias` nudges it once a step."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_experts, cfg.d_model))
        nn.init.normal_(self.weight, std=cfg.init_std)
        self.n_experts, self.k = cfg.n_experts, cfg.moe_top_k
        self.score, self.normalise = cfg.moe_score, cfg.moe_norm_topk
        self.groups = cfg.moe_route_groups
        self.group_limit = cfg.moe_route_group_limit or cfg.moe_route_groups
        self.capacity_factor = cfg.capacity_factor
        self.balance_by = cfg.balance
        self.aux_coef, self.z_coef = cfg.aux_loss_coef, cfg.z_loss_coef
        self.jitter, self.random_second = cfg.router_jitter, cfg.moe_random_routing
        self.bias_rate = cfg.balance_bias_rate
        if cfg.balance == "bias":
            self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
            self.step_load: torch.Tensor | None = None  # (E,) assignments of this step's training forwards
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
        probs = affinity(logits, self.score)
        gates, experts = top_k_gates(probs, self.k, random_second, self.normalise, self.choice(probs))  # (N, k)
        chosen = experts[experts >= 0]
        load = torch.bincount(chosen, minlength=E)
        if self.capacity_factor == 0:  # dropless: every assignment is kept
            keep = experts >= 0
        else:
            keep = self.slots(experts, E, self.capacity_factor, batch)
        token = torch.arange(N, device=logits.device)[:, None].expand(N, self.k)
        self._count(load)
        return Routing(token=token[keep], expert=experts[keep], gate=gates[keep], load=load,
                       dropped=chosen.numel() - keep.sum(), aux_loss=self.aux_loss(probs, experts[:, 0]),
                       z_loss=self.z_coef * logits.logsumexp(-1).pow(2).mean())

    def choice(self, probs: torch.Tensor) -> torch.Tensor | None:
        """What the top-k ranks (N, E): the affinities plus the balancing bias, limited to each token's best
        groups; None: the affinities themselves (Switch, GShard)."""
        if self.balance_by != "bias" and self.groups == 1:
            return None
        choice = probs.detach() + self.expert_bias if self.balance_by == "bias" else probs.detach()
        if self.group_limit < self.groups:
            choice = limit_to_groups(choice, self.groups, self.group_limit)
        return choice

    def aux_loss(self, probs: torch.Tensor, first_choice: torch.Tensor) -> torch.Tensor:
        """Switch's loss over the affinities as shares of each token's mass (sigmoid scores normalised per
        token, as DeepSeek-V3's complementary sequence-wise loss takes them); none under balance = "none"."""
        if self.balance_by == "none":
            return probs.new_zeros(())
        shares = probs if self.score == "softmax" else probs / probs.sum(-1, keepdim=True)
        return load_balancing_loss(shares, first_choice, self.aux_coef, self.balance)

    def _count(self, load: torch.Tensor) -> None:
        """Under balance = "bias": add a training forward's load to the step's (evaluation does not count)."""
        if self.balance_by == "bias" and self.training and torch.is_grad_enabled():
            load = load.detach().float()
            self.step_load = load if self.step_load is None else self.step_load + load

    @torch.no_grad()
    def update_bias(self, load: torch.Tensor) -> None:
        """DeepSeek-V3 (Sec. 2.1.2): bias_i += rate * sign(mean load - load_i), from the load (E,) of the
        step's global batch; every rank that routes these experts passes the same load, so holds the same
        bias. Forgets the step's own count."""
        self.expert_bias += self.bias_rate * torch.sign(load.mean() - load)
        self.step_load = None


def bias_routers(model: nn.Module) -> list[Router]:
    """The routers of the model's MoE blocks that balance by bias (model.balance = "bias")."""
    return [m.router for m in moe_layers(model) if m.router.balance_by == "bias"]


def update_biases(routers: list[Router], total=lambda load: load) -> None:
    """After an optimizer step: each router's bias from its step's load, every router's load passed (as
    one tensor) through `total`, which sums it over the ranks that split the batch
    (tessel.parallel.expert.balance.BiasUpdate); one process: as it is. A router that saw no
    training forward (a pipeline stage's unused chunk) counts zero load."""
    if not routers:
        return
    loads = torch.stack([r.step_load if r.step_load is not None else torch.zeros_like(r.expert_bias)
                         for r in routers])
    for router, load in zip(routers, total(loads)):
        router.update_bias(load)


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
    return out.index_add_(0, s.token, y * s.gate[:, None].to(y.dtype))  # in place: no copy of the zeros


class LocalDispatcher:
    """Every expert lives here: group token rows by expert, and bring them back. No communication."""

    def __init__(self, n_experts: int):
        self.n_experts = n_experts

    def dispatch(self, x: torch.Tensor, r: Routing) -> tuple[torch.Tensor, torch.Tensor, object]:
        """x (N, C) -> rows grouped by local expert (M, C), rows per local expert (El,), state for combine."""
        rows, s = sort_by_expert(x, r, self.n_experts)
        return rows, s.counts, s

    def combine(self, y: torch.Tensor, state: object) -> torch.Tensor:
        """Expert outputs (M, C) in dispatch order -> gate-weighted output per token (N, C)."""
        return weighted_scatter(y, state)


class ExpertLinear(nn.Module):
    """E bias-free linear maps stacked in one weight (E, out, in): experts shard along dim 0."""

    def __init__(self, n_experts: int, d_in: int, d_out: int, std: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_experts, d_out, d_in))
        nn.init.normal_(self.weight, std=std)


def grouped_mm_works(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes x (M, K) @ w (G, K, N) here: the installed torch has it for the
    device (the CPU; a GPU of compute capability 9.0 or more) and the dtype (fp32 on the CPU, bf16 on a GPU),
    and the rows are 16-byte aligned, as its kernels need. Not for no rows at all (its backward refuses them)."""
    if not hasattr(torch, "_grouped_mm") or x.dtype != w.dtype or x.size(0) == 0:
        return False
    if x.device.type == "cuda":
        ok = x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    else:
        ok = x.device.type == "cpu" and x.dtype == torch.float32
    return ok and all(n * x.element_size() % 16 == 0 for n in (x.size(1), w.size(-1)))


def padded_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, K), rows grouped as counts (G,) -> each group @ its w (G, K, N) -> (M, N), by one batched matmul
    over the groups padded to the largest: the grouped matmul where torch has none."""
    G, M = counts.numel(), x.size(0)
    width = int(counts.max()) if M else 0
    group = torch.repeat_interleave(torch.arange(G, device=x.device), counts, output_size=M)  # (M,)
    starts = torch.cumsum(counts, 0) - counts
    slot = group * width + torch.arange(M, device=x.device) - starts.index_select(0, group)  # (M,)
    padded = x.new_zeros(G * width, x.size(1)).index_copy(0, slot, x).view(G, width, x.size(1))
    return torch.bmm(padded, w).view(G * width, w.size(-1)).index_select(0, slot)


class ContiguousGrad(torch.autograd.Function):
    """The identity whose backward makes its gradient contiguous: torch._grouped_mm's backward refuses the
    stride-0 gradient an expanded one (a sum's) arrives as."""

    @staticmethod
    def forward(ctx, y: torch.Tensor) -> torch.Tensor:
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad.contiguous()


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """x (M, K), rows grouped as counts (G,) -> group g's rows @ w[g] (G, K, N) -> (M, N): one grouped GEMM
    over the variable-size groups (torch._grouped_mm, whose offsets are the groups' ends), else padded_mm."""
    if grouped_mm_works(x, w):
        y = torch._grouped_mm(x, w, offs=torch.cumsum(counts, 0, dtype=torch.int32))
        return ContiguousGrad.apply(y) if y.requires_grad else y
    return padded_mm(x, w, counts)


class Experts(nn.Module):
    """E SwiGLU MLPs (or this rank's share of them) applied to tokens grouped by expert, as three grouped
    GEMMs over the experts' variable-size groups (dropless experts take any number of rows each)."""

    def __init__(self, n_experts: int, d_model: int, d_ff: int, std: float):
        super().__init__()
        self.w_gate = ExpertLinear(n_experts, d_model, d_ff, std)
        self.w_up = ExpertLinear(n_experts, d_model, d_ff, std)
        self.w_down = ExpertLinear(n_experts, d_ff, d_model, std)

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # x: (M, C), rows grouped by local expert, counts (El,) rows for each
        w_gate, w_up, w_down = (lin.weight.transpose(1, 2) for lin in (self.w_gate, self.w_up, self.w_down))
        h = F.silu(grouped_mm(x, w_gate, counts)) * grouped_mm(x, w_up, counts)  # (M, d_ff)
        return grouped_mm(h, w_down, counts)  # (M, C)


def per_expert_loop(experts: Experts, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """Experts.forward as a Python loop over the experts: the reference its grouped GEMMs are tested against."""
    outs = []
    for e, chunk in enumerate(x.split(counts)):
        h = F.silu(chunk @ experts.w_gate.weight[e].t()) * (chunk @ experts.w_up.weight[e].t())  # (n_e, d_ff)
        outs.append(h @ experts.w_down.weight[e].t())  # (n_e, C)
    return torch.cat(outs) if outs else x[:0]


class SharedExperts(nn.Module):
    """DeepSeekMoE's always-on experts: n of them, each a SwiGLU as wide as a routed expert, run on every
    token as one SwiGLU n times as wide (the same function: the hidden units of the n just sit side by side)."""

    def __init__(self, n: int, d_model: int, d_ff: int, std: float):
        super().__init__()
        self.w_gate = nn.Linear(d_model, n * d_ff, bias=False)
        self.w_up = nn.Linear(d_model, n * d_ff, bias=False)
        self.w_down = nn.Linear(n * d_ff, d_model, bias=False)
        for lin in (self.w_gate, self.w_up, self.w_down):
            nn.init.normal_(lin.weight, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class MoE(nn.Module):
    """Drop-in for the SwiGLU MLP of a Block. After each forward, `aux_loss` holds the
    router's auxiliary losses (load balance + z-loss) for the training loss to add."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.router = Router(cfg)
        self.experts = Experts(cfg.n_experts, cfg.d_model, cfg.ffn_dim, cfg.init_std)
        if cfg.n_shared_experts:
            self.shared = SharedExperts(cfg.n_shared_experts, cfg.d_model, cfg.ffn_dim, cfg.init_std)
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
        if hasattr(self, "shared"):
            out = out + self.shared(flat)
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
