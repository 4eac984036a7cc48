"""The trainer's optimizer: AdamW parameter groups, the learning-rate schedule.

Which parameters get weight decay is tessel.parallel.weight_decay's (below the
strategies that build their own optimizer, ZeRO's). The schedule is a linear warm-up, then cosine decay to min_lr
(GPT-3, appendix B). The kernel follows the parameters' device
(tessel.parallel.adamw: fused on CUDA, foreach elsewhere).

Strategies that build their own optimizer (ZeRO's, which steps the shard a rank
owns) make the same groups from tessel.parallel.weight_decay: tessel.parallel
never imports tessel.train.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn

from tessel.config import TrainConfig
from tessel.parallel.adamw import adamw
from tessel.parallel.weight_decay import gets_weight_decay, param_groups


def build_optimizer(params: list[nn.Parameter], t: TrainConfig,
                    decay: Callable[[nn.Parameter], bool] = gets_weight_decay) -> torch.optim.Optimizer:
    """AdamW with the config's hyper-parameters; `decay` picks who gets weight decay."""
    return adamw(param_groups(params, t.weight_decay, decay), lr=t.lr, betas=(t.beta1, t.beta2))


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every tensor the optimizer steps (what the gradient norm is taken over)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warm-up, then cosine decay from lr to min_lr at the last step."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps)
    progress = min(1.0, (step - t.warmup_steps) / span)
    return t.min_lr + 0.5 * (t.lr - t.min_lr) * (1 + math.cos(math.pi * progress))


def build_scheduler(opt: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    """lr_at as a torch scheduler: LambdaLR multiplies the base lr (t.lr) by lr_at / lr."""
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_at(step, t) / t.lr)
