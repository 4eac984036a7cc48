"""A Hugging Face MoE's router loss under a pipeline: one loss over every layer, exact, though the layers are on
other stages.

transformers' load_balancing_loss_func takes its statistics over the router outputs of every layer at once:

    aux = c * E * sum_i f_i * P_i,   f_i = C_i / R,   P_i = S_i / R

C_i: the top-k choices of expert i, S_i: the sum of the router probabilities of i, R: the rows (tokens x
layers), each summed over all layers (tessel.models.hf.moe.balance_loss), and under
aux_loss_scope = "global" over every rank that splits the batch (dp x ep; Qiu et al. 2025). Under pp a
stage holds only some layers. C and R are counts, constant to autograd, so the loss is linear in each
stage's probability sums S^s given them:

    aux = sum_s  c * E / R^2 * sum_i C_i * S^s_i

so stage s back-propagates d aux / d S^s = c * E * C / R^2 through its own routers, in its own backward,
once it knows the totals C and R. Each stage launches an asynchronous all-reduce of its (C^s, R^s, S^s)
at the end of each training forward, on a process group of its own over pp (and dp x ep for the global
scope), and waits for it only in that micro-batch's backward: by then every stage has run the micro-batch's
forward (the gradient a stage receives comes from the last stage, which ran after them all; a dp or ep peer
runs the same schedule and waits on nobody's all-reduce before launching its own), so the wait does not
block the schedule.
The last stage's forward is the last of the micro-batch: it waits there and reports the loss's value; the
other stages report 0, so the pipeline's summed loss is transformers' (`RouterShare` is that surrogate:
the value on the last stage, the exact gradient everywhere).

Scope over micro-batches (the executor seeds each micro-batch's aux with 1/m):
- per micro-batch (1F1B; aux_loss_scope = "local" under any schedule): the statistics of micro-batch j
  alone; the step's aux is the mean over micro-batches of transformers' loss on each.
- the whole step (GPipe, where every forward of the step precedes every backward, on every stage): the
  statistics of all m micro-batches together, so the step's aux is transformers' loss on the whole batch.
  The last stage reports it at its last forward (m times, as the executor divides by m).

Global scope: data parallelism averages each rank's gradient of the one replicated loss over the N = dp x ep
ranks, so each rank seeds N * c * E * C / R^2, as AllReduceBalanceStatistics's backward does. Under context
parallelism the cp ranks hold chunks of the same sequences: their statistics join the sum (in either scope)
and N counts them too (tessel.parallel.context.moe).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.axes import TOKEN_AXES
from tessel.mesh import Mesh
from tessel.models.hf.moe import RouterLoss, RouterLossSpec, balance_statistics


class Pending:
    """One forward's (C, R, S) summed over the group: an asynchronous all-reduce, waited on at most once."""

    def __init__(self, stats: torch.Tensor, group):
        self.total = stats.clone()
        self.work = dist.all_reduce(self.total, group=group, async_op=True) if group is not None else None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.total


class StepStatistics:
    """The pending statistics of this step's micro-batches on this rank, and which of them a loss spans."""

    def __init__(self, n_experts: int, micro_batches: int, whole_step: bool, group):
        self.E, self.m, self.whole_step, self.group = n_experts, micro_batches, whole_step, group
        self.pending: list[Pending] = []

    def add(self, stats: torch.Tensor) -> int:
        """Launch this forward's all-reduce; returns its micro-batch (forwards come in micro-batch order)."""
        if len(self.pending) == self.m:
            self.pending = []  # a new step
        self.pending.append(Pending(stats, self.group))
        return len(self.pending) - 1

    def totals(self, mb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(C (E,), R (), S (E,)) over the group, of micro-batch mb or of the whole step."""
        if self.whole_step:
            total = torch.stack([p.wait() for p in self.pending]).sum(0)
        else:
            total = self.pending[mb].wait()
        E = self.E
        return total[:E], total[E], total[E + 1:]

    def ready(self, mb: int) -> bool:
        """Whether the loss of micro-batch mb is known at its forward (on the last stage): its own, or, for
        the whole step, the last micro-batch's."""
        return not self.whole_step or mb == self.m - 1


class RouterShare(torch.autograd.Function):
    """This stage's part of the router loss: value on the last stage (its micro-batch's whole loss), 0
    elsewhere; gradient d aux / d S^s = seed * C / R^2 on every stage, from the totals (module docstring)."""

    @staticmethod
    def forward(ctx, prob_sums: torch.Tensor, stats: StepStatistics, mb: int, seed: float, value: float | None):
        ctx.stats, ctx.mb, ctx.seed = stats, mb, seed
        return prob_sums.new_tensor(0.0 if value is None else value)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        C, R, _ = ctx.stats.totals(ctx.mb)
        return grad * ctx.seed * C / R ** 2, None, None, None, None


class StageRouterLoss:
    """The router loss of one pipeline chunk's layers, for the executor (tessel.parallel.pipeline.aux's
    StageLoss): called after each training forward, it returns this chunk's RouterShare."""

    present = True  # every stage takes part in every micro-batch's all-reduce, whatever layers it holds

    def __init__(self, chunk: nn.Module, spec: RouterLossSpec, stats: StepStatistics, last: bool, shards: int):
        recorder = RouterLoss(chunk, spec)
        self.recorder, self.stats, self.last = recorder, stats, last
        # c * E, times N under the global scope; times m for the whole step (the executor seeds 1/m)
        self.seed = recorder.coef * recorder.n_experts * shards * (stats.m if stats.whole_step else 1)

    def __call__(self) -> torch.Tensor | None:
        r = self.recorder
        logits = r.take_logits()
        if not logits:
            return None  # no training forward ran (evaluation, sampling)
        counts, prob_sums, rows = balance_statistics(logits, r.n_experts, r.top_k)
        mb = self.stats.add(torch.cat([counts.to(prob_sums.dtype), rows.to(prob_sums.dtype)[None],
                                       prob_sums.detach()]))
        return RouterShare.apply(prob_sums, self.stats, mb, self.seed, self._value(mb))

    def _value(self, mb: int) -> float | None:
        """The loss's value where this is the last stage and it is known: c*E*sum C*S / R^2 (times m for the
        whole step, reported once); None elsewhere (the share reports 0)."""
        if not self.last or not self.stats.ready(mb):
            return None
        C, R, S = self.stats.totals(mb)
        m = self.stats.m if self.stats.whole_step else 1
        return m * self.recorder.coef * self.recorder.n_experts * float((C * S).sum() / R ** 2)


def stage_router_losses(chunks: nn.ModuleList, mesh: Mesh, spec: RouterLossSpec, scope: str, micro_batches: int,
                        whole_step: bool, last: list[bool]) -> list[StageRouterLoss]:
    """One StageRouterLoss per chunk of this pipeline rank (collective: makes the statistics' process group).

    scope "global": the group spans pp x dp x ep x cp (every stage, every rank that splits the batch or its
    sequences); "local": pp x cp (a rank's shard of the batch is whole sequences over cp). last[c]: chunk c is
    the pipeline's last stage. One chunk per rank (tessel.config refuses virtual stages)."""
    axes = ("pp", *TOKEN_AXES) if scope == "global" else ("pp", "cp")
    group = None
    for ranks in mesh.all_groups(axes):  # every rank creates every group, in the same order
        g = dist.new_group(ranks)
        if mesh.rank in ranks:
            group = g
    shards = mesh.size(*TOKEN_AXES) if scope == "global" else mesh.size("cp")
    stats = StepStatistics(spec.n_experts, micro_batches, whole_step, group)
    return [StageRouterLoss(chunk, spec, stats, last[c], shards) for c, chunk in enumerate(chunks)]
