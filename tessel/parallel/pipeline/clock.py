"""Timestamps of one pipeline step, without a device sync per action.

The runner stamps the start and end of every forward, backward, send and
receive wait. On CPU a stamp is `time.perf_counter()`. On CUDA it is an event
recorded on the current stream: closing each action with a synchronize would
drain the launch queue between actions, so the host could no longer run ahead
of the device (and a receive's wait, which under NCCL only makes the stream
wait, would measure nothing). The events are read once, when the step's
timeline is asked for (the bubble metric, the trace), which waits for the
device at that point only.
"""

from __future__ import annotations

import time

import torch


class StepClock:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.t0 = 0.0  # host perf_counter at the step's start
        self._ev0 = None
        self._raw: list[tuple] = []
        self._events: list[tuple] | None = []

    def start(self) -> float:
        self.t0 = time.perf_counter()
        self._raw, self._events = [], None
        if self.cuda:
            self._ev0 = self.stamp()
        return self.t0

    def stamp(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def add(self, kind: str, mb: int, chunk: int, start, end) -> None:
        self._raw.append((kind, mb, chunk, start, end))

    def events(self) -> list[tuple]:
        """(kind, micro-batch, chunk, start_s, end_s), seconds from the step's start."""
        if self._events is None:
            if self.cuda:
                torch.cuda.synchronize()  # once per step read, not once per action
                seconds = [self._ev0.elapsed_time(ev) / 1e3 for *_, s, e in self._raw for ev in (s, e)]
            else:
                seconds = [t - self.t0 for *_, s, e in self._raw for t in (s, e)]
            self._events = [(k, mb, c, seconds[2 * i], seconds[2 * i + 1])
                            for i, (k, mb, c, _, _) in enumerate(self._raw)]
        return self._events
