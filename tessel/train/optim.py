"""The trainer's optimizer: AdamW parameter groups, the learning-rate schedule.

Weight decay pulls weights towards zero: it regularises matrices (embeddings,
linear weights), while on norms' gains and biases it would only pull the
scale and offset of each feature, so those get none (nanoGPT's
configure_optimizers; GPT-3 trains with decay 0.1, Brown et al. 2020,
appendix B). The schedule is a linear warm-up, then cosine decay to min_lr
(GPT-3, appendix B). The kernel follows the parameters' device
(tessel.parallel.adamw: fused on CUDA, foreach elsewhere).

Strategies that build their own optimizer (ZeRO's, which steps the shard a rank
owns) take these groups from their caller like a torch optimizer does:
tessel.parallel never imports tessel.train.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.nn as nn

from tessel.config import TrainConfig
from tessel.parallel.adamw import adamw


def gets_weight_decay(p: nn.Parameter) -> bool:
    """Matrices do; norms, biases and other vectors do not."""
    return p.dim() >= 2


def param_groups(params: Iterable[nn.Parameter], weight_decay: float,
                 decay: Callable[[nn.Parameter], bool] = gets_weight_decay) -> list[dict]:
    """AdamW parameter groups: those `decay` picks with weight_decay, the rest with none."""
    params = list(params)
    return [{"params": [p for p in params if decay(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}]


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
