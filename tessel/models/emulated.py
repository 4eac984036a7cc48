"""Blocks on an emulated accelerator: their own compute, then a fixed wait that uses no CPU.

A host that drives a GPU spends a kernel's duration waiting, not computing.
On this project's shared 2-core machine two ranks that both compute slow each
other down, so a pipeline's stages do not behave as independent devices and
its measured bubble mixes the schedule with CPU contention. Wrapping each
block in `EmulatedBlock` makes every forward take `fwd_s` more and every
backward `bwd_s` more in `time.sleep` (which releases the CPU), so stages of
equal wait act as equal, independent devices. Used by benchmarks/pp_bubble.py
(`--device-ms`) and the runner's bubble test.
"""

from __future__ import annotations

import time

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

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # backward of a block is about twice its forward (two matmuls per forward one)
        out = DeviceTime.apply(self.block(x, cos, sin), self.fwd_s, self.fwd_s)
        weight = next(self.block.parameters())
        return out + WeightTime.apply(weight, self.fwd_s, out.dtype)  # x + 0 == x exactly


def emulate_devices(model: nn.Module, fwd_s: float) -> nn.Module:
    """Wrap every block of a GPT in place; returns the model."""
    for i, block in enumerate(model.layers):
        model.layers[i] = EmulatedBlock(block, fwd_s)
    return model


class EmulatedDevice:
    """An accelerator of `flops` FLOP/s, emulated: each block it runs waits its matmul FLOPs / flops.

    The wait follows the work: a block's forward does 2 FLOPs per parameter it holds per token
    (Kaplan et al. 2020), so a tensor-parallel shard (1/tp of the parameters) waits 1/tp as long,
    a bigger micro-batch longer, and backward twice the forward. Hooks, not wrappers: parameter
    names, checkpoints and tensor-parallel plans see the plain model. `flops` may change while it
    runs (a device that slows down).
    """

    def __init__(self, flops: float):
        self.flops = flops

    def seconds(self, block: nn.Module, tokens: int) -> float:
        params = sum(p.numel() for p in block.parameters())
        return 2 * params * tokens / self.flops

    def _hook(self, block: nn.Module, args, out: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation and sampling: not a training step's work
            return out
        fwd_s = self.seconds(block, out.shape[0] * out.shape[1])  # (B, T, d): B*T tokens
        return DeviceTime.apply(out, fwd_s, 2 * fwd_s)


def emulate_device(model: nn.Module, flops: float) -> EmulatedDevice:
    """Put every block of a GPT (`model.layers`) on an emulated device of `flops` FLOP/s; returns it."""
    device = EmulatedDevice(flops)
    for block in model.layers:
        block.register_forward_hook(device._hook)
    return device
