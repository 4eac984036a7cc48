"""Global-batch load balancing: the router's statistics summed over the ranks that split the batch.

Switch's load-balancing loss alpha*E*sum_i f_i*P_i is not linear in the batch:
computed on each rank's shard and averaged, it differs from the loss of the whole
batch, and it only asks each shard to be balanced (a harder, different constraint).
Qiu et al. 2025, "Demons in the Detail: On Implementing Load Balancing Loss for
Training Specialized Mixture-of-Expert Models", Sec. 3: all-reduce the per-expert
token counts and router probabilities over the data-parallel ranks before forming
f_i and P_i, so every rank computes the aux loss of the global batch.

Under context parallelism (tessel.parallel.context.moe) the cp ranks hold chunks of
the same sequences: their statistics are summed too (the group is dp x ep x cp), and
under aux_loss_scope = "local" over cp alone (sequence_balance), so that each rank's
shard of the batch is whole sequences, as in one process.

Scope, exactly: one forward call (one micro-batch, one accumulation chunk) of every
rank in the group (GlobalBalance). Under 1F1B (and under gradient accumulation)
micro-batch 0's backward runs before the last micro-batch's forward exists, so its
gradient cannot depend on the last one's routing without holding every
micro-batch's graph until the end of the step. With one micro-batch (and
grad_accum = 1) this is the loss of the whole global batch in one process.

Under a GPipe pipeline every forward of the step runs before every backward, so the
statistics of the whole step are known when the first backward needs them
(StepBalance): the loss is then the whole global batch's, however many
micro-batches. It is linear in the probability sums S given the counts C and the
token count R (alpha*E*sum_i C_i*S_i/R^2), so each micro-batch back-propagates
d/dS = alpha*E*C/R^2 of the step's totals through its own router.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.axes import TOKEN_AXES
from tessel.mesh import Mesh
from tessel.models.moe import BalanceStatistics, bias_routers, local_balance, moe_layers, update_biases


class AllReduceBalanceStatistics(torch.autograd.Function):
    """Qiu et al. 2025 (global-batch balancing): stats -> their sum over the group (dp x ep, and the cp
    ranks that hold chunks of the same sequences).

    Every rank then holds the same global aux loss and back-propagates it; data
    parallelism averages gradients over the same ranks. The adjoint of a replicated
    sum under that averaged objective is the sum of the ranks' incoming gradients,
    so the backward is an all-reduce too: after the average, each rank's router gets
    exactly the one-process gradient of the global aux loss."""

    @staticmethod
    def forward(ctx, stats: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        total = stats.clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        total = grad.contiguous().clone()
        dist.all_reduce(total, group=ctx.group)
        return total, None


def all_reduce_statistics(stats: torch.Tensor, group) -> torch.Tensor:
    """Sum (differentiably) over the group; a no-op outside training, where no aux loss is taken and
    only some ranks may run a forward (sampling)."""
    if not torch.is_grad_enabled():
        return stats
    return AllReduceBalanceStatistics.apply(stats, group)


class GlobalBalance:
    """tessel.models.moe.BalanceStatistics over every token of the group's ranks (one forward call each)."""

    def __init__(self, group):
        self.group = group

    def __call__(self, counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.is_grad_enabled():
            return local_balance(counts, probs)
        E = probs.size(1)
        # one collective: [sum of probabilities (E), first-choice counts (E), tokens]
        packed = torch.cat([probs.sum(0), counts.to(probs.dtype), probs.new_full((1,), probs.size(0))])
        total = all_reduce_statistics(packed, self.group)
        n = total[2 * E]
        return total[E:2 * E] / n, total[:E] / n


class StepShare(torch.autograd.Function):
    """P for Switch's alpha*E*sum_i f_i*P_i with f = 1: the step's loss / (alpha*E*E) in each entry on the
    step's last micro-batch (m times it: the pipeline averages the m micro-batches' losses), 0 on the others;
    backward: d/dS = (that gradient) * N*m*C/R^2 from the step's totals, the exact gradient of the whole
    step's loss (N = ranks in the group: data parallelism averages their gradients of the one loss)."""

    @staticmethod
    def forward(ctx, prob_sums: torch.Tensor, step: "StepBalance", value: torch.Tensor | None):
        ctx.step = step
        return prob_sums.new_zeros(prob_sums.shape) if value is None else value.expand(prob_sums.shape).clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        step = ctx.step
        step.backwards += 1
        C, R, _ = step.totals()
        return grad * step.scale * C / R ** 2, None, None


class StepBalance:
    """tessel.models.moe.BalanceStatistics over the whole step of a GPipe pipeline (module docstring): every
    rank of the group, every micro-batch. One per router: its calls are the step's m forwards, then (under
    full recompute) calls inside the backwards, which add nothing; a step ends once every forward had its
    backward."""

    def __init__(self, group, micro_batches: int, shards: int):
        self.group, self.m = group, micro_batches
        self.scale = shards * micro_batches
        self.stats: list[torch.Tensor] = []  # [C (E), R, S (E)] of each forward of the step, over the group
        self.backwards = 0

    def totals(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        total = torch.stack(self.stats).sum(0)
        E = (total.numel() - 1) // 2
        return total[:E], total[E], total[E + 1:]

    def __call__(self, counts: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.is_grad_enabled():
            return local_balance(counts, probs)
        if self.stats and self.backwards == len(self.stats):  # every forward had its backward: a new step
            self.stats, self.backwards = [], 0
        prob_sums = probs.sum(0)
        value = None
        if len(self.stats) < self.m and self.backwards == 0:  # a forward, not a recompute inside a backward
            stats = torch.cat([counts.to(probs.dtype), probs.new_full((1,), probs.size(0)), prob_sums.detach()])
            if self.group is not None:
                dist.all_reduce(stats, group=self.group)
            self.stats.append(stats)
            if len(self.stats) == self.m:
                C, R, S = self.totals()
                value = self.m * (C * S).sum() / R ** 2 / C.numel()
        return torch.ones_like(prob_sums), StepShare.apply(prob_sums, self, value)


def global_balance(mesh: Mesh) -> BalanceStatistics:
    """Statistics over the ranks that split the batch (dp x ep; tp ranks see the same tokens) and the cp ranks
    that split its sequences (tessel.parallel.context.moe)."""
    group = mesh.group(*TOKEN_AXES)
    return local_balance if group is None else GlobalBalance(group)


def sequence_balance(mesh: Mesh) -> BalanceStatistics:
    """aux_loss_scope = "local": statistics over this rank's shard of the batch, whose sequences the cp ranks
    split (summed over cp; one process's per-shard statistics)."""
    group = mesh.group("cp")
    return local_balance if group is None else GlobalBalance(group)


def balance_over_batch(model: nn.Module, mesh: Mesh, whole_step: int | None = None) -> None:
    """aux_loss_scope = "global": every MoE router of the model takes f and P over the whole batch: of each
    forward call, or (whole_step = m, the micro-batches of a GPipe step) of the whole step."""
    for moe in moe_layers(model):
        moe.router.balance = (global_balance(mesh) if whole_step is None
                              else StepBalance(mesh.group(*TOKEN_AXES), whole_step, mesh.size(*TOKEN_AXES)))


def balance_over_sequences(model: nn.Module, mesh: Mesh) -> None:
    """aux_loss_scope = "local" under cp: every MoE router takes f and P over its shard's whole sequences."""
    for moe in moe_layers(model):
        moe.router.balance = sequence_balance(mesh)


class BiasUpdate:
    """model.balance = "bias" (DeepSeek-V3's auxiliary-loss-free balancing) after each optimizer step: each
    router's bias from its load over the step's global batch, the loads of every router of this rank's model
    summed in one all-reduce over the ranks that split the batch (dp x ep, and cp's chunks of the same
    sequences; tp ranks route the same tokens, pp stages hold other routers), so that every rank that holds a
    router holds the same bias. Reads the plan's model when it runs: the model the steps left (a pipeline
    rank's chunks)."""

    def __init__(self, plan, mesh: Mesh):
        self.plan, self.group = plan, mesh.group(*TOKEN_AXES)

    def _sum(self, loads: torch.Tensor) -> torch.Tensor:
        if self.group is not None:
            dist.all_reduce(loads, group=self.group)
        return loads

    def __call__(self) -> None:
        update_biases(bias_routers(self.plan.model), self._sum)
