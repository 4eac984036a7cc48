"""Numerical faults and the stop request, decided alike on every rank.

A non-finite loss or gradient norm on any rank skips the step on every rank;
the guard rolls back after `nan_tolerance` skipped steps in a row. The same
all-reduce carries a stop request (tessel.train.fault.preempt), so a signal
to any rank stops them all after the same step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def agree(loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int, device: torch.device,
          group=None) -> tuple[bool, int]:
    """One all-reduce per step over `group` (None: every rank), so its ranks take the same decisions:
    (the loss and gradient norm are finite on every rank, the signal some rank was asked to stop on or 0)."""
    finite = bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad_norm).all())
    flags = torch.tensor([0.0 if finite else 1.0, float(stop_signal)], device=device)
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return flags[0].item() == 0.0, int(flags[1].item())
