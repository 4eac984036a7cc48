"""The float8 matmul of a block's linear layer: torchao's float8 training matmul, the one its Float8Linear
calls (Micikevicius et al. 2022, "FP8 Formats for Deep Learning": e4m3 for the forward's operands, e5m2 for
the gradients, each tensor scaled so that its amax lands on the format's largest value).

Called with the layer's own (high-precision) weight, so parameters, their names, checkpoints, ZeRO's shards
and exports stay exactly what they are in bf16: only the matmul's operands are cast, dynamically, each step.
Why not torchao's module swap alone: tessel's tensor-parallel layers (tessel.parallel.tensor) are not
nn.Linear; one callable serves them and the plain layers alike. Under tensor parallelism each rank scales the
shard it holds (tensorwise: one scale per shard, not per whole tensor; rowwise: per row of the shard), which
is never coarser than one device's scaling.

Recipes (train.fp8_recipe): "tensorwise", one scale per tensor, the fastest; "rowwise", one scale per row,
more robust to outliers. Autocast's dtype is applied to the input first, as torch does for F.linear, so the
output has the dtype a bf16 run's would (torchao's module does this on CUDA only; tessel does it on every
device, so the CPU's emulation rounds as the GPU does).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
from torchao.float8.config import Float8LinearConfig
from torchao.float8.float8_linear import matmul_with_hp_or_float8_args
from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig


class Float8Matmul:
    """x @ W^T (+ b) with x and W cast to float8 by `recipe`; emulated where the device has no float8 matmul."""

    def __init__(self, recipe: str, emulate: bool):
        config = Float8LinearConfig.from_recipe_name(recipe)
        self.config = dataclasses.replace(config, emulate=emulate)
        gemm = (self.config.gemm_config_output, self.config.gemm_config_grad_input,
                self.config.gemm_config_grad_weight)
        self.mm_config = LinearMMConfig(*(ScaledMMConfig(emulate, g.use_fast_accum, False, self.config.pad_inner_dim)
                                          for g in gemm))

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        kind = x.device.type
        if torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        y = matmul_with_hp_or_float8_args.apply(x, weight.t(), self.mm_config, self.config)
        return y if bias is None else y + bias.to(y.dtype)


def fits_float8(weight: torch.Tensor) -> bool:
    """float8 GEMMs need both of the weight's dimensions to be multiples of 16 (torch._scaled_mm)."""
    return weight.dim() == 2 and weight.size(0) % 16 == 0 and weight.size(1) % 16 == 0


def linear_forward(module: nn.Linear, matmul: Float8Matmul):
    """An nn.Linear's forward through `matmul`, set on the instance (its class, names and state unchanged)."""
    def forward(x: torch.Tensor) -> torch.Tensor:
        return matmul(x, module.weight, module.bias)
    return forward

