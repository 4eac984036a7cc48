"""Global-batch load balancing: the router's statistics summed over the ranks that split the batch.

Switch's load-balancing loss alpha*E*sum_i f_i*P_i is not linear in the batch:
computed on each rank's shard and averaged, it differs from the loss of the whole
batch, and it only asks each shard to be balanced (a harder, different constraint).
Qiu et al. 2025, "Demons in the Detail: On Implementing Load Balancing Loss for
Training Specialized Mixture-of-Expert Models", Sec. 3: all-reduce the per-expert
token counts and router probabilities over the data-parallel ranks before forming
f_i and P_i, so every rank computes the aux loss of the global batch.

Scope, exactly: one forward call (one micro-batch, one accumulation chunk) of every
rank in the group. Statistics are not summed over micro-batches: under 1F1B (and
under gradient accumulation) micro-batch 0's backward runs before the last
micro-batch's forward exists, so its gradient cannot depend on the last one's
routing without holding every micro-batch's graph until the end of the step.
With one micro-batch (and grad_accum = 1) this is the loss of the whole global
batch in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.models.moe import BalanceStatistics, local_balance, moe_layers


class AllReduceBalanceStatistics(torch.autograd.Function):
    """Qiu et al. 2025 (global-batch balancing): stats -> their sum over the group.

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


def global_balance(mesh: Mesh) -> BalanceStatistics:
    """Statistics over the ranks that split the batch (dp x ep; tp ranks see the same tokens)."""
    group = mesh.group("dp", "ep")
    return local_balance if group is None else GlobalBalance(group)


def balance_over_batch(model: nn.Module, mesh: Mesh) -> None:
    """aux_loss_scope = "global": every MoE router of the model takes f and P over the whole batch."""
    for moe in moe_layers(model):
        moe.router.balance = global_balance(mesh)
