"""Numerical faults and the stop request, decided alike on every rank.

A non-finite loss or gradient norm on any rank skips the step on every rank;
the guard rolls back after `nan_tolerance` skipped steps in a row. The same
all-reduce carries a stop request (tessel.train.fault.preempt), so a signal
to any rank stops them all after the same step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Agreement:
    """What every rank of the group decided after the all-reduce, with the step's loss and gradient norm as
    numbers on the host."""
    finite: bool  # the loss and the gradient norm are finite on every rank
    stop_signal: int  # the signal some rank was asked to stop on, or 0
    loss: float
    grad_norm: float

    @classmethod
    def of(cls, values: list[float]) -> "Agreement":
        """From agreed_values' numbers, read on the host."""
        bad_anywhere, signal, loss, norm = values
        return cls(bad_anywhere == 0.0, int(signal), loss, norm)


def agreed_values(loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int, device: torch.device,
                  group=None) -> torch.Tensor:
    """[bad anywhere, stop signal, loss, gradient norm] on the device, after one all-reduce over `group` (None:
    every rank) of the flags, so its ranks take the same decisions. Element 0 decides the update on the device
    (tessel.parallel.adamw.step_unless); the four travel to the host in one copy (tessel.train.overlap.HostCopy),
    read when the host can wait without stalling the device: each `.item()` waits for the device to drain."""
    bad = ~(torch.isfinite(loss).all() & torch.isfinite(grad_norm).all())
    flags = torch.stack([bad.float(), torch.full((), float(stop_signal), device=device)])
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return torch.cat([flags, loss.detach().float().reshape(1), grad_norm.detach().float().reshape(1)])


def agree(loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int, device: torch.device,
          group=None) -> Agreement:
    """agreed_values, read on the host at once (one copy of the four)."""
    return Agreement.of(agreed_values(loss, grad_norm, stop_signal, device, group).tolist())
