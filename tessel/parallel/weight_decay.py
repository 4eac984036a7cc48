"""AdamW parameter groups: which parameters get weight decay.

Weight decay pulls weights towards zero: it regularises matrices (embeddings,
linear weights), while on norms' gains and biases it would only pull the
scale and offset of each feature, so those get none (nanoGPT's
configure_optimizers; GPT-3 trains with decay 0.1, Brown et al. 2020,
appendix B). Here, below both the strategies that build their own optimizer
(ZeRO's, PipeDream's per-micro-batch one) and the trainer (tessel.train.optim),
so that tessel.parallel never imports tessel.train.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch.nn as nn


def gets_weight_decay(p: nn.Parameter) -> bool:
    """Matrices do; norms, biases and other vectors do not."""
    return p.dim() >= 2


def param_groups(params: Iterable[nn.Parameter], weight_decay: float,
                 decay: Callable[[nn.Parameter], bool] = gets_weight_decay) -> list[dict]:
    """AdamW parameter groups: those `decay` picks with weight_decay, the rest with none."""
    params = list(params)
    return [{"params": [p for p in params if decay(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}]
