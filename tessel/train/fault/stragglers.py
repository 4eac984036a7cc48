"""Stragglers: every `straggler_every` steps the ranks all-gather the time of their local forward
passes; a rank slower than `straggler_factor` x the median of the others is named in a warning and in
the `straggler_rank` metric."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class ForwardTimer:
    """Sums the wall time of some modules' forward passes (hooks; no change to the model): a rank's
    compute (tessel.parallel.runner.Runner.timed_modules: its model, or its pipeline chunks)."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device):
        self.total, self._t0, self.device = 0.0, None, device
        for module in modules:
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _pre(self, *_):
        # training forwards only: evaluation and sampling run without grad and are not a step's work
        self._t0 = time.perf_counter() if torch.is_grad_enabled() else None

    def _post(self, *_):
        if self._t0 is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._t0 is not None:
            self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


def straggler_report(times: list[float], factor: float, min_gap_s: float) -> dict:
    """Per-rank local times -> metrics; the slowest rank is compared with the median of the others
    (with two ranks a median over all would be their mean); `straggler_rank` is -1 if none stands out."""
    slow = max(range(len(times)), key=lambda r: times[r])
    others = [t for r, t in enumerate(times) if r != slow] or [times[slow]]
    med = statistics.median(others)
    ratio = times[slow] / med if med > 0 else 1.0
    is_straggler = len(times) > 1 and ratio > factor and times[slow] - med > min_gap_s
    return {"straggler_ratio": ratio, "straggler_rank": slow if is_straggler else -1,
            "rank_time_max_s": times[slow], "rank_time_median_s": med}


def gather_times(local: float, device: torch.device) -> list[float]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    out = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([local], device=device))
    return [float(t.item()) for t in out]
