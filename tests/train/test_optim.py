"""The trainer's AdamW groups and learning-rate schedule (tessel.train.optim)."""

import pytest
import torch
import torch.nn as nn

from tessel.config import TrainConfig
from tessel.parallel.weight_decay import param_groups
from tessel.train.optim import build_optimizer, build_scheduler, lr_at, optimizer_params


def _net() -> nn.Module:
    return nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4), nn.LayerNorm(4))


def test_weight_decay_on_matrices_only():
    net = _net()
    decayed, plain = param_groups(net.parameters(), 0.1)
    assert decayed["weight_decay"] == 0.1 and plain["weight_decay"] == 0.0
    assert [tuple(p.shape) for p in decayed["params"]] == [(10, 4), (4, 4)]  # embedding, linear weight
    assert [tuple(p.shape) for p in plain["params"]] == [(4,), (4,), (4,)]  # bias, norm gain and bias


def test_build_optimizer_takes_the_config():
    net = _net()
    t = TrainConfig(lr=3e-4, beta1=0.8, beta2=0.9, weight_decay=0.2)
    opt = build_optimizer(list(net.parameters()), t, decay=lambda p: False)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.2, 0.0]
    assert opt.param_groups[1]["lr"] == 3e-4 and opt.param_groups[1]["betas"] == (0.8, 0.9)
    assert optimizer_params(opt) == list(net.parameters())


def test_scheduler_follows_lr_at():
    t = TrainConfig(steps=20, lr=1.0, min_lr=0.1, warmup_steps=5)
    opt = build_optimizer(list(_net().parameters()), t)
    sched = build_scheduler(opt, t)
    for step in range(20):
        assert opt.param_groups[0]["lr"] == pytest.approx(lr_at(step, t))
        opt.step()
        sched.step()
