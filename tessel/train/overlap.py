"""The host ahead of the device: a step's batch in, its numbers out and its time, without the host waiting.

On a GPU the host queues kernels and the device runs them later. Whatever makes
the host wait for a value the device has not computed yet (`.item()`,
`.tolist()`, `float(t)`, a copy to pageable CPU memory, a synchronize) drains
that queue: the device then idles while the host queues the next step's first
kernels. Copies between pageable host memory and the device wait too (CUDA
stages them through a pinned buffer; torch synchronizes the stream for one
without non_blocking). So a step's batch goes in through pinned memory with
non_blocking; its loss, gradient norm and agreed flags come out the same way, a
copy queued behind the step's work with an event recorded after it, read once
the next step is queued (by then the copy is done or about to be, and the
device has a whole step to run); and its time is taken between two CUDA events
the stream passes, read with its numbers. PyTorch's tutorial "A guide on good
usage of non_blocking and pin_memory() in PyTorch" explains the copies;
torchtitan and Megatron-LM read a step's loss late the same way.

On the CPU nothing runs ahead of the host: the copy is the values themselves and
the time is the host's.
"""

from __future__ import annotations

import time

import torch


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor (a batch) on `device`; to a GPU through pinned memory, without the host waiting."""
    if device.type != "cuda" or t.device == device:
        return t
    # pinned: the device reads it by DMA while the host goes on; the caching host allocator keeps the buffer
    # until the copy that reads it is done
    return t.pin_memory().to(device, non_blocking=True)


class HostCopy:
    """Device values copied to the host behind the work queued so far; `read` gives them as numbers."""

    def __init__(self, values: torch.Tensor):
        values = values.detach()
        self.event = None
        if values.device.type == "cuda":
            self.host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self.host.copy_(values, non_blocking=True)  # queued on the device's stream, behind the step
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(values.device))
        else:  # already on the host (a copy, so that a later in-place change does not reach it)
            self.host = values.clone()

    def ready(self) -> bool:
        """Whether read() would return at once."""
        return self.event is None or self.event.query()

    def read(self) -> list[float]:
        """The values; on a GPU, waits for the copy, which follows the work queued before it."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class StepClock:
    """One step's seconds: between two CUDA events the stream passes at the step's start and end (on the
    device's clock: what the step's kernels took, idle gaps included), or the host's clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda, self.device = device.type == "cuda", device
        self.t0, self.t1 = time.perf_counter(), None
        if self.cuda:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record(torch.cuda.current_stream(device))

    def stop(self) -> None:
        """The step is queued."""
        if self.cuda:
            self.end.record(torch.cuda.current_stream(self.device))
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        """Read after the step's numbers (HostCopy.read): on a GPU its end event is passed by then."""
        if self.cuda:
            self.end.synchronize()
            return self.start.elapsed_time(self.end) / 1e3
        return self.t1 - self.t0
