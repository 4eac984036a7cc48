"""The emulated device (tessel.models.emulated.EmulatedDevice): a block takes max(its CPU math, its device time),
not their sum; time spent not computing is still added; a late wake-up is not the device's.

The sleeps the device asks for are recorded (the module's clock, wrapped): they are set by CPU time, which the
machine's load does not stretch, so the assertions hold on a busy machine too.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch
import torch.nn as nn

from tessel.models import emulated
from tessel.models.emulated import emulate_device

D = 16  # the block's width: 2 * (D*D + D) parameters * TOKENS / FLOPS seconds of device time
TOKENS = 8
FLOPS = 2 * (D * D + D) * TOKENS / 0.040  # a forward takes 40 ms on the device, a backward 80 ms


def _spin(seconds: float) -> None:
    """CPU work: this thread computes for `seconds` of its own CPU time."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Spin(torch.autograd.Function):
    """Identity whose forward computes for fwd_s of CPU and backward for bwd_s: a block's math."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        _spin(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _spin(ctx.bwd_s)
        return grad, None, None


class Block(nn.Module):
    def __init__(self, fwd_s: float, bwd_s: float, idle_s: float = 0.0):
        super().__init__()
        self.lin, self.fwd_s, self.bwd_s, self.idle_s = nn.Linear(D, D), fwd_s, bwd_s, idle_s

    def forward(self, x):
        if self.idle_s:  # a wait without CPU (a collective inside the block)
            threading.Event().wait(self.idle_s)
        return Spin.apply(self.lin(x), self.fwd_s, self.bwd_s)


class Model(nn.Module):
    def __init__(self, *blocks: Block, gap_s: float = 0.0):
        super().__init__()
        self.layers, self.gap_s = nn.ModuleList(blocks), gap_s

    def forward(self, x):
        for i, block in enumerate(self.layers):
            if i and self.gap_s:  # the host waits between blocks without computing (a receive)
                threading.Event().wait(self.gap_s)
            x = block(x)
        return x


class Clock:
    """The module's `time`, its sleeps recorded; `late` seconds added to each (a host that wakes late)."""

    def __init__(self, late: float = 0.0):
        self.late, self.asked = late, []

    perf_counter = staticmethod(time.perf_counter)
    thread_time = staticmethod(time.thread_time)

    def sleep(self, s: float) -> None:
        self.asked.append(s)
        time.sleep(s + self.late)


def _run(model: Model, clock: Clock, monkeypatch, device: list | None = None) -> tuple[list[float], list[float]]:
    """(sleeps asked in forward, in backward) for one forward and backward of `model` on the device."""
    monkeypatch.setattr(emulated, "time", clock)
    on = emulate_device(model, FLOPS)
    if device is not None:
        device.append(on)
    x = torch.randn(1, TOKENS, D, requires_grad=True)
    with torch.no_grad():  # not timed (evaluation): the first call's one-time set-up is not a block's math
        model(x)
    # a garbage collection inside a block is CPU time the block would be credited with: ms in a long pytest
    # process, enough to move a sleep past the tolerance (seen once in a run of the suite's files)
    gc.disable()
    try:
        out = model(x)
        forward = list(clock.asked)
        out.sum().backward()
    finally:
        gc.enable()
    return forward, clock.asked[len(forward):]


def test_a_block_waits_only_what_its_math_leaves_of_its_device_time(monkeypatch):
    device = []
    forward, backward = _run(Model(Block(0.015, 0.030)), Clock(), monkeypatch, device)
    # 40 ms forward, 15 of them computed: 25 left to wait (the sum would wait all 40 after the math)
    assert forward == pytest.approx([0.025], abs=0.004)
    assert backward == pytest.approx([0.080 - 0.030], abs=0.004)  # 80 ms backward, paced across its math
    book = device[0].ledger  # what benchmarks/hetero.py --account reads
    assert book.kernels == 2 and book.device_s == pytest.approx(0.120)
    assert book.math_s == pytest.approx(0.045, abs=0.004)


def test_math_longer_than_the_device_time_is_not_padded(monkeypatch):
    forward, backward = _run(Model(Block(0.050, 0.090)), Clock(), monkeypatch)
    assert forward == [] and backward == []


def test_time_without_cpu_inside_a_block_is_not_device_work(monkeypatch):
    forward, _ = _run(Model(Block(0.010, 0.0, idle_s=0.020)), Clock(), monkeypatch)
    assert forward == pytest.approx([0.030], abs=0.004)  # the 20 ms idle is added: only the 10 ms of math count


def test_a_late_wake_up_comes_off_the_next_kernel_unless_the_host_waited_since(monkeypatch):
    late = 0.010
    forward, _ = _run(Model(Block(0.005, 0.0), Block(0.005, 0.0)), Clock(late), monkeypatch)
    # the device started the second block when the first ended, not when the host woke 10 ms later
    assert forward == pytest.approx([0.035, 0.035 - late], abs=0.004)
    forward, _ = _run(Model(Block(0.005, 0.0), Block(0.005, 0.0), gap_s=0.020), Clock(late), monkeypatch)
    # a 20 ms wait for input between them: the device idled too, and nothing comes off
    assert forward == pytest.approx([0.035, 0.035], abs=0.004)
