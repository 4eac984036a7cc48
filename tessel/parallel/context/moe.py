"""Mixture-of-experts blocks under context parallelism: a forward call's tokens are whole sequences.

Every cp rank routes its own chunks: a token's scores, choices and gates are its
own and need nothing from other ranks. Two things a router computes depend on
every token of the forward call, which cp splits over its ranks:

- capacity (tessel.models.moe.capacity, GShard's group: the forward call's
  tokens). SequenceSlots counts it on the whole sequences, as one process does:
  each rank's choices (k small integers a token, no gradient) are all-gathered
  over cp and laid out in sequence order (tessel.parallel.context.layout); slots
  are handed out on the whole batch (every first choice before any second, by
  token order within a choice: assign_slots) and each rank keeps its own rows.
  Exact: a cp run drops the very tokens one process drops.
- the load-balancing statistics f and P (Switch's alpha*E*sum f_i*P_i, not linear
  in the tokens): summed over the cp group before they are formed
  (tessel.parallel.expert.balance.GlobalBalance, whose all-reduce is a named
  autograd function; Qiu et al. 2025), over cp alone for aux_loss_scope =
  "local" (a rank's shard of the batch is whole sequences) and over dp x ep x cp
  for "global". Mixtral's balance loss takes the same statistics.

The router z-loss (Zoph et al. 2022) is a mean over tokens of a per-token term:
each rank's mean over its chunks, averaged over cp with the rest of the loss, is
the mean over the whole sequences (every rank holds as many tokens), so it needs
nothing. Generation runs whole prompts on every rank (CPContext.whole): capacity
is then the rank's own, as in one process.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.models.moe import assign_slots, capacity, local_slots, moe_layers
from tessel.parallel.context import layout
from tessel.parallel.context.context import CPContext


class SequenceSlots:
    """tessel.models.moe.SlotAssignment over the whole sequences whose chunks the cp ranks hold."""

    def __init__(self, ctx: CPContext):
        self.ctx = ctx
        self._orders: dict[tuple[int, str], torch.Tensor] = {}

    def order(self, seq_len: int, device: torch.device) -> torch.Tensor:
        """(T,) the sequence positions of every rank's tokens, rank after rank (the all-gather's order)."""
        key = (seq_len, str(device))
        if key not in self._orders:
            cp = self.ctx.ring.size
            held = [i for rank in range(cp) for i in layout.positions(seq_len, cp, rank)]
            self._orders[key] = torch.tensor(held, dtype=torch.long, device=device)
        return self._orders[key]

    def __call__(self, experts: torch.Tensor, n_experts: int, factor: float, batch: int) -> torch.Tensor:
        cp = self.ctx.size
        if cp == 1:  # whole sequences on every rank (generation): one process's capacity
            return local_slots(experts, n_experts, factor, batch)
        N, k = experts.shape  # N = batch * (this rank's tokens of each sequence)
        local, T = N // batch, N // batch * cp
        parts = [torch.empty_like(experts) for _ in range(cp)]
        dist.all_gather(parts, experts.contiguous(), group=self.ctx.ring.group)
        held = torch.cat([part.view(batch, local, k) for part in parts], dim=1)  # (B, T, k) rank after rank
        whole = torch.empty_like(held)
        whole[:, self.order(T, experts.device)] = held  # (B, T, k) in sequence order
        keep, _ = assign_slots(whole.view(batch * T, k), n_experts, capacity(batch * T, n_experts, factor))
        mine = self.ctx.positions(local, experts.device)
        return keep.view(batch, T, k)[:, mine].reshape(N, k)


def whole_sequence_capacity(model: nn.Module, ctx: CPContext) -> None:
    """Every MoE router of the reference GPT counts capacity on the whole sequences (module docstring)."""
    for moe in moe_layers(model):
        moe.router.slots = SequenceSlots(ctx)
