"""Point-to-point traffic between pipeline stages: batched isend/irecv with shapes known ahead.

What crosses a stage boundary is what GPipe (Huang et al. 2019) and 1F1B
(Narayanan et al. 2019, PipeDream; 2021, PTD-P) send: a micro-batch's
activation forward, its gradient backward.

Every rank of a pipeline knows the activation shape of a step before it
starts, (micro-batch, T, d_model) in the model's dtype, so a receive allocates
its buffer and posts at once: there is no shape message in front of each
tensor (torch.distributed.pipelining does the same after its first step).
The runner hands this module one run of consecutive communication actions of
its schedule, which becomes one `dist.batch_isend_irecv`.

Nothing here is differentiable by autograd: the runner feeds received
gradients to `torch.autograd.backward` itself, which is how a pipeline
schedule (not the autograd graph) decides when each backward runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from tessel.mesh import Mesh

SCALAR_TAG = 7  # the step's loss, last rank -> the others (activations and gradients use tag 0)


class Incoming(NamedTuple):
    """A posted receive: its buffer is valid once `work.wait()` returns."""
    buffer: torch.Tensor
    work: dist.Work


class StageLinks:
    """This rank's links to the other ranks of its pipeline (its coordinates on dp/ep/tp fixed)."""

    def __init__(self, mesh: Mesh, loss_rank: int | None = None):
        self.ranks = mesh.group_ranks(("pp",))  # global rank of each pipeline rank
        # the pipeline rank holding the last stage, where the loss is: the last rank, or rank 0 in ZBV's V
        self.loss_rank = len(self.ranks) - 1 if loss_rank is None else loss_rank
        self.group = mesh.group("pp")
        self.device = mesh.device
        self._pending_sends: list = []

    def exchange(self, sends: list[tuple[int, torch.Tensor]],
                 recvs: list[tuple[int, tuple[int, ...], torch.dtype]]) -> list[Incoming]:
        """Post sends and receives as one batch; returns an Incoming for each receive.

        sends: (pipeline peer, tensor); recvs: (pipeline peer, shape, dtype).
        Sends are waited on lazily (`wait_sends`), so a rank never stalls on a
        peer that is not yet ready to receive; the tensors stay referenced
        until then so their memory is not reused while in flight.
        """
        ops, buffers = [], []
        # order inside the batch: sends first, then receives, the same on every
        # rank, so the n-th message on a link meets the n-th receive (NCCL has no tags)
        for peer, tensor in sends:
            tensor = tensor.contiguous()
            ops.append(dist.P2POp(dist.isend, tensor, self.ranks[peer], group=self.group))
            self._pending_sends.append(tensor)
        for peer, shape, dtype in recvs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self.ranks[peer], group=self.group))
            buffers.append(buf)
        if not ops:
            return []
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # a coalesced batch (NCCL) answers with one handle for all
            works = works[-1:] * len(ops)
        self._pending_sends.extend(works[: len(sends)])
        return [Incoming(buf, work) for buf, work in zip(buffers, works[len(sends):])]

    def wait_sends(self) -> None:
        for item in self._pending_sends:
            if not isinstance(item, torch.Tensor):
                item.wait()
        self._pending_sends.clear()

    def expect_from_last(self) -> Incoming | None:
        """Post now the receive of the fp32 scalar the last rank sends later with `send_to_all`.

        Under its own tag (a gloo slot of its own), so it never queues behind
        or ahead of the activations and gradients on the same link. gloo only:
        NCCL has no tags. None on the last rank (or without a pipeline).
        """
        if self.group is None or dist.get_rank() == self.ranks[self.loss_rank]:
            return None
        buf = torch.empty((), dtype=torch.float32, device=self.device)
        return Incoming(buf, dist.irecv(buf, self.ranks[self.loss_rank], group=self.group, tag=SCALAR_TAG))

    def send_to_all(self, t: torch.Tensor) -> None:
        """The last rank's half of `expect_from_last`; waited on with the other sends."""
        t = t.detach().float()
        for peer in self.ranks[:self.loss_rank] + self.ranks[self.loss_rank + 1:]:
            self._pending_sends += [t, dist.isend(t, peer, group=self.group, tag=SCALAR_TAG)]

    def sum_over_pipeline(self, t: torch.Tensor) -> torch.Tensor:
        """The sum of t over the pipeline's ranks, on each (a loss with parts on every stage)."""
        if self.group is not None:
            dist.all_reduce(t, group=self.group)
        return t

    def broadcast_from_last(self, t: torch.Tensor) -> torch.Tensor:
        """The loss rank's value of t on every pipeline rank (the loss, a sampled token)."""
        if self.group is not None:
            dist.broadcast(t, src=self.ranks[self.loss_rank], group=self.group)
        return t
