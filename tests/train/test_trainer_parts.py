"""Learning-rate schedule and optimizer groups."""

import math

import pytest

from tessel.config import TrainConfig
from tessel.train.optim import lr_at


def test_warmup_then_cosine_to_min_lr():
    t = TrainConfig(steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at(0, t) == pytest.approx(0.1)
    assert lr_at(9, t) == pytest.approx(1.0)
    assert lr_at(60, t) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr_at(110, t) == pytest.approx(0.1)
