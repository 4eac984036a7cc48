"""Which devices multiply in float8: compute capability 8.9 or later (Ada, Hopper, Blackwell).

Elsewhere a float8 run is either refused (an older GPU: before any rank starts, tessel.commands.launch) or
emulated (the CPU: torchao's `emulate`, the same casts and scales with the matmul done in high precision), so
that every layout is tested on a laptop with the numbers a GPU would round to.
"""

from __future__ import annotations

import torch

FP8_CAPABILITY = (8, 9)


def multiplies_in_float8(device: torch.device) -> bool:
    """True on a GPU with float8 tensor cores; False on the CPU (emulated) and on older GPUs (refused)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= FP8_CAPABILITY


def float8_refusal(device_index: int = 0) -> str | None:
    """Why this machine's GPU cannot train in float8, naming it; None when it can."""
    capability = torch.cuda.get_device_capability(device_index)
    if capability >= FP8_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device_index)
    return (f"'fp8' needs float8 matmuls (compute capability 8.9 or later: Ada, Hopper, Blackwell); this "
            f"machine's {name} has {capability[0]}.{capability[1]}; use 'bf16'")
