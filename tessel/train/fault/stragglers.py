"""Stragglers: every `straggler_every` steps the ranks all-gather the time of their local forward
passes; a rank slower than `straggler_factor` x the median of the others is named in a warning and in
the `straggler_rank` metric."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist


class ForwardTimer:
    """Sums the time of some modules' forward passes (hooks; no change to the model): a rank's compute
    (tessel.parallel.runner.Runner.timed_modules: its model, or its pipeline chunks).

    On a GPU the forward's kernels run after the hooks return, so the time is taken between two CUDA
    events recorded on the stream, read when the sum is taken: a synchronize in the hook would make the
    host wait for every forward before it queues the backward, on every step."""

    def __init__(self, modules: list[torch.nn.Module], device: torch.device):
        self.total, self._t0, self.device = 0.0, None, device
        self.cuda = device.type == "cuda"
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []  # (start, end) of each forward
        for module in modules:
            module.register_forward_pre_hook(self._pre)
            module.register_forward_hook(self._post)

    def _pre(self, *_):
        # training forwards only: evaluation and sampling run without grad and are not a step's work
        if not torch.is_grad_enabled():
            self._t0 = None
        elif self.cuda:
            self._t0 = torch.cuda.Event(enable_timing=True)
            self._t0.record()
        else:
            self._t0 = time.perf_counter()

    def _post(self, *_):
        if self._t0 is None:
            return
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._t0, end))
        else:
            self.total += time.perf_counter() - self._t0
        self._t0 = None

    def take(self) -> float:
        """Seconds of forward since the last take (on a GPU, waits for the last timed forward to finish)."""
        if self._events:
            self._events[-1][1].synchronize()
            self.total += sum(start.elapsed_time(end) for start, end in self._events) / 1e3
            self._events = []
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
    return torch.cat(out).tolist()  # one copy to the host, not one per rank
