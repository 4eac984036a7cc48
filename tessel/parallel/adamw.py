"""AdamW's kernels, chosen from the parameters: one fused kernel on CUDA, torch's multi-tensor path elsewhere.

torch's AdamW runs the same update three ways: a loop of a few kernels per
parameter (its default on the CPU), `foreach` (one multi-tensor kernel per
operation over every parameter of a device and dtype) and `fused` (the whole
update of every parameter in one kernel). On a GPU a step of a loop launches
hundreds of small kernels, whose launches cost more than their arithmetic;
fused does it in a few launches and reads its step counts on the device, so it
never waits for the host (torchtitan and llm.c step this way). Fused needs
floating tensors on its device; on the CPU foreach is bitwise the loop's
update (each foreach op is the loop's op, run on every tensor), so CPU runs and
their checkpoints keep their trajectory.

The fused kernel also skips a step on the device: given `found_inf` (a float
tensor on the parameters' device, 1 for "skip"), it leaves the parameters and
moments alone and takes back the step count it added; this is how
torch.amp.GradScaler skips a step with an inf gradient without a host read.
`step_unless` hands it the agreed "non-finite" flag (tessel.train.fault.numerics).

Where a step count lives follows torch (Adam._init_group): on the parameter's
device for fused, on the CPU otherwise; `step_count` puts a restored one there.
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

# device types whose parameters get the fused kernel (tests add "cpu": torch has one there too, with found_inf, so
# the CUDA path's device-side skip runs on a machine without a GPU)
FUSED_DEVICE_TYPES: tuple[str, ...] = ("cuda",)


def _tensors(params: Iterable) -> list[torch.Tensor]:
    """Every tensor of torch.optim's first argument (parameters, or groups of them)."""
    out = []
    for item in params:
        out.extend(item["params"] if isinstance(item, dict) else [item])
    return out


def kernel_options(params: Iterable) -> dict[str, bool]:
    """{'fused': True} where every parameter is a floating tensor on a device with the fused kernel (one device
    type for all), else {'foreach': True}."""
    tensors = _tensors(params)
    kinds = {p.device.type for p in tensors}
    fused = (len(kinds) == 1 and kinds <= set(FUSED_DEVICE_TYPES)
             and all(torch.is_floating_point(p) for p in tensors))
    return {"fused": True} if fused else {"foreach": True}


def adamw(params: Iterable[nn.Parameter] | Iterable[dict], **hyper) -> torch.optim.AdamW:
    """torch.optim.AdamW with the kernel kernel_options picks for these parameters."""
    params = [dict(g, params=list(g["params"])) if isinstance(g, dict) else g for g in params]
    return torch.optim.AdamW(params, **hyper, **kernel_options(params))


def skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `step_unless` decides on the device: a fused AdamW (or a subclass: ZeRO's), not a wrapper."""
    groups = optimizer.param_groups
    return isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(groups) and all(
        g.get("fused") for g in groups)


def step_unless(optimizer: torch.optim.Optimizer, skip: torch.Tensor) -> None:
    """optimizer.step() unless `skip` (a 0-d tensor on the parameters' device, nonzero: skip), decided by the
    fused kernel on the device (see the module's docstring); needs skips_on_device(optimizer)."""
    optimizer.found_inf = skip.detach().to(torch.float32)
    try:
        optimizer.step()
    finally:
        del optimizer.found_inf


def step_count(optimizer: torch.optim.Optimizer, param: torch.Tensor, value: float | torch.Tensor) -> torch.Tensor:
    """AdamW's state["step"] of `param` holding `value`, where its kernel keeps it (torch's Adam._init_group): on
    the parameter's device in float32 when fused (or capturable), else on the CPU (a loaded tensor keeps its
    dtype; a number gets torch's default)."""
    group = next((g for g in optimizer.param_groups if any(p is param for p in g["params"])), {})
    on_device = bool(group.get("fused") or group.get("capturable"))
    step = value.detach().reshape(()).clone() if torch.is_tensor(value) else torch.tensor(float(value))
    return step.to(device=param.device, dtype=torch.float32) if on_device else step.cpu()
