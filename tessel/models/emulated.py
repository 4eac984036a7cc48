"""Blocks on an emulated accelerator: a wait that uses no CPU stands for the device's time.

A host that drives a GPU spends a kernel's duration waiting, not computing.
On this project's shared 2-core machine two ranks that both compute slow each
other down, so a pipeline's stages do not behave as independent devices and
its measured bubble mixes the schedule with CPU contention. Two emulations:

- `EmulatedBlock` (emulate_devices): every forward takes `fwd_s` more and
  every backward `bwd_s` more in `time.sleep` (which releases the CPU), so
  stages of equal wait act as equal, independent devices; the backward's
  input and weight halves wait apart (a split backward runs them apart).
  Used by benchmarks/pp_bubble.py (`--device-ms`) and the runner's bubble test,
  which compare equal stages, where the block's own CPU math, added on top,
  is the same on every stage.
- `EmulatedDevice` (emulate_device, runtime.emulate_flops): a device of a
  given FLOP/s, each block taking its FLOPs' time, the block's own CPU math
  inside that time rather than on top of it, so that devices of different
  speeds are as far apart as their speeds say (heterogeneous devices, slow
  ranks, re-plans: benchmarks/hetero.py, benchmarks/replan.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn as nn


class DeviceTime(torch.autograd.Function):
    """Identity whose forward and backward each take a fixed wall time without using the CPU."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fwd_s: float, bwd_s: float) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return grad, None, None


class WeightTime(torch.autograd.Function):
    """A zero that depends on a weight; its backward takes a fixed wall time and gives the weight a zero
    gradient. It stands for the weight-gradient half of a block's backward, the half a split backward
    defers (tessel.parallel.pipeline.split_backward runs it in W, a whole backward with the rest)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, bwd_s: float, dtype: torch.dtype) -> torch.Tensor:
        ctx.bwd_s = bwd_s
        return torch.zeros((), dtype=dtype, device=weight.device)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        time.sleep(ctx.bwd_s)
        return None, None, None


class EmulatedBlock(nn.Module):
    """A transformer block on an emulated device: forward waits fwd_s, backward 2 x fwd_s, half of it for
    the input's gradient and half for the weights' (Qi et al. 2023 take the two as equal)."""

    def __init__(self, block: nn.Module, fwd_s: float):
        super().__init__()
        self.block, self.fwd_s = block, fwd_s

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask=None) -> torch.Tensor:
        # backward of a block is about twice its forward (two matmuls per forward one)
        out = DeviceTime.apply(self.block(x, cos, sin, mask), self.fwd_s, self.fwd_s)
        weight = next(self.block.parameters())
        return out + WeightTime.apply(weight, self.fwd_s, out.dtype)  # x + 0 == x exactly


def emulate_devices(model: nn.Module, fwd_s: float) -> nn.Module:
    """Wrap every block of a GPT in place; returns the model."""
    for i, block in enumerate(model.layers):
        model.layers[i] = EmulatedBlock(block, fwd_s)
    return model


@dataclass
class Ledger:
    """Where an emulated device's time went (benchmarks/hetero.py --account reads it)."""
    kernels: int = 0
    device_s: float = 0.0  # the kernels' device time
    math_s: float = 0.0  # the CPU their own math took, inside their device time where it fits
    oversleep_s: float = 0.0  # how much later than asked the host woke from the kernels' waits
    credit_s: float = 0.0  # oversleep taken off the next kernels' waits


class _Kernel:
    """One kernel on an emulated device, begun (EmulatedDevice.begin) and not yet ended."""

    def __init__(self, cpu0: float, credited0: float, ahead: float):
        self.cpu0, self.credited0 = cpu0, credited0  # this thread's CPU seconds and the device's credit then
        self.ahead = ahead  # how long before the host began it the device could have (EmulatedDevice.begin)


class _BlockCall:
    """One call of a block: its forward kernel, then the backward kernel its two markers bracket."""

    def __init__(self, forward: _Kernel):
        self.forward, self.backward = forward, None
        self.bwd_s = 0.0
        self.paced = False  # a KernelStart at the input ends the backward kernel (the input needs a gradient)


class KernelEnd(torch.autograd.Function):
    """Identity at a block's output: its backward kernel begins here (the output's gradient has arrived)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, device: "EmulatedDevice", call: _BlockCall) -> torch.Tensor:
        ctx.device, ctx.call = device, call
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        call = ctx.call
        call.backward = ctx.device.begin()
        if not call.paced:  # nothing at the input will end it: the whole wait here, before the math
            ctx.device.end(call.backward, call.bwd_s)
        return grad, None, None


class KernelStart(torch.autograd.Function):
    """Identity at a block's input: its backward kernel ends here (the block's backward math is done)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, device: "EmulatedDevice", call: _BlockCall) -> torch.Tensor:
        ctx.device, ctx.call = device, call
        call.paced = True
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.device.end(ctx.call.backward, ctx.call.bwd_s)
        return grad, None, None


class EmulatedDevice:
    """An accelerator of `flops` FLOP/s, emulated: each block it runs takes its matmul FLOPs / flops.

    The time follows the work: a block's forward does 2 FLOPs per parameter it holds per token
    (Kaplan et al. 2020), so a tensor-parallel shard (1/tp of the parameters) takes 1/tp as long,
    a bigger micro-batch longer, and backward twice the forward. Hooks, not wrappers: parameter
    names, checkpoints and tensor-parallel plans see the plain model. `flops` may change while it
    runs (a device that slows down).

    Two things make it behave as a device rather than as this CPU plus a sleep:

    - The CPU that computes a block's numbers is the emulated device doing that block's work,
      so the CPU seconds of the block's own math count towards its device time and the block
      waits only the rest: max(math, device time), not their sum. The sum would add to every
      block a cost that does not scale with `flops` (a device twice as fast would run a block
      less than twice as fast, the more so the smaller the block). Only CPU time counts: what a
      block spends not computing (tensor parallelism's collectives inside it, the core taken by
      another process) is still added, as on a real device. Backward is paced between markers
      at the block's output and input (KernelEnd, KernelStart), where autograd runs its math.
    - A device runs its queue of kernels back to back while the host runs ahead; it does not
      wake late from a sleep. When this host oversleeps a kernel's end, the next kernel is
      counted from when the device would have started it: the oversleep comes off its wait,
      less any time the host spent waiting in between (a receive, a collective: the device
      could not have started before its input came either).
    """

    def __init__(self, flops: float):
        self.flops = flops
        self.credited = 0.0  # CPU seconds counted inside ended kernels (an enclosing one does not count them again)
        self._late = 0.0  # how much later than the device the host woke from the last kernel's wait
        self._woke, self._woke_cpu = time.perf_counter(), time.thread_time()  # when, and its CPU clock then
        self._open: list[_BlockCall] = []  # forwards begun and not ended (a stack, should blocks nest)
        self.ledger = Ledger()

    def seconds(self, block: nn.Module, tokens: int) -> float:
        params = sum(p.numel() for p in block.parameters())
        return 2 * params * tokens / self.flops

    def begin(self) -> _Kernel:
        """A kernel starts: how far ahead the device is is the host's oversleep less its waits since."""
        now, cpu = time.perf_counter(), time.thread_time()
        waited = (now - self._woke) - (cpu - self._woke_cpu)  # wall time since the last wait without CPU
        return _Kernel(cpu, self.credited, max(0.0, self._late - waited))

    def end(self, kernel: _Kernel, device_s: float) -> None:
        """The kernel's math is done: wait what is left of its device time."""
        own = time.thread_time() - kernel.cpu0 - (self.credited - kernel.credited0)  # a nested kernel counts its own
        self.credited += own
        rest = device_s - own - kernel.ahead
        t0 = time.perf_counter()
        if rest > 0:
            time.sleep(rest)
        self._woke, self._woke_cpu = time.perf_counter(), time.thread_time()
        self._late = self._woke - t0 - rest if rest > 0 else 0.0
        book = self.ledger
        book.kernels, book.device_s, book.math_s = book.kernels + 1, book.device_s + device_s, book.math_s + own
        book.oversleep_s += self._late
        book.credit_s += min(kernel.ahead, max(0.0, device_s - own))

    def _pre_hook(self, block: nn.Module, args: tuple):
        if not torch.is_grad_enabled():  # evaluation and sampling: not a training step's work
            return None
        call = _BlockCall(self.begin())
        self._open.append(call)
        x = args[0]
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return (KernelStart.apply(x, self, call), *args[1:])
        return None

    def _hook(self, block: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return out
        call = self._open.pop()
        fwd_s = self.seconds(block, out.shape[0] * out.shape[1])  # (B, T, d): B*T tokens
        self.end(call.forward, fwd_s)
        call.bwd_s = 2 * fwd_s
        return KernelEnd.apply(out, self, call)


def emulate_device(model: nn.Module, flops: float) -> EmulatedDevice:
    """Put every block of a GPT (`model.layers`) on an emulated device of `flops` FLOP/s; returns it."""
    device = EmulatedDevice(flops)
    for block in model.layers:
        block.register_forward_pre_hook(device._pre_hook)
        block.register_forward_hook(device._hook)
    return device
