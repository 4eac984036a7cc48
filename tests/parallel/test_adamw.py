"""AdamW's kernels (tessel.parallel.adamw): foreach is the loop's update bit for bit, fused is it within a few
ulps and skips a step on the device; every optimizer tessel builds takes the kernel of its parameters' device."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from tessel.config import TrainConfig
from tessel.mesh import make_mesh
from tessel.parallel import adamw as kernels
from tessel.parallel.zero.zero_parallel import zero_parallel
from tessel.parallel.weight_decay import param_groups
from tessel.train.optim import build_optimizer

SHAPES = [(33, 17), (5,), (64, 64), (1,)]


def _params() -> list[nn.Parameter]:
    torch.manual_seed(0)
    return [nn.Parameter(torch.randn(s)) for s in SHAPES]


def _train(params: list[nn.Parameter], **kernel) -> torch.optim.AdamW:
    """5 steps of AdamW (decayed and plain groups) on fixed random gradients."""
    groups = param_groups(params, 0.1)
    opt = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), **kernel)
    gen = torch.Generator().manual_seed(1)
    for _ in range(5):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


def test_foreach_is_the_loop_bit_for_bit_and_fused_within_ulps():
    loop, foreach, fused = _params(), _params(), _params()
    _train(loop, foreach=False), _train(foreach, foreach=True), _train(fused, fused=True)
    for a, b, c in zip(loop, foreach, fused):
        assert torch.equal(a, b)  # each foreach op is the loop's op on every tensor: the same bits
        # the fused kernel computes the same update in one pass, in another order of fp32 operations: a few
        # ulps of the update and of the weight (|w| ~ 1, ulp 1.2e-7) per step, measured 6e-8 after 5 steps;
        # 1e-6 bounds that, while a missed step or a wrong bias correction moves a weight by ~lr = 1e-2
        torch.testing.assert_close(c, a, rtol=0, atol=1e-6)


def test_the_kernel_follows_the_parameters(monkeypatch):
    cpu = _params()
    assert kernels.kernel_options(cpu) == {"foreach": True}
    assert build_optimizer(cpu, TrainConfig()).param_groups[0]["foreach"] is True
    # on a device with the fused kernel (CUDA; here the CPU standing in for it) floating parameters get it,
    # anything else (an integer tensor, a second device type) the multi-tensor path
    monkeypatch.setattr(kernels, "FUSED_DEVICE_TYPES", ("cpu",))
    assert kernels.kernel_options(param_groups(cpu, 0.1)) == {"fused": True}
    opt = build_optimizer(cpu, TrainConfig())
    assert all(g["fused"] for g in opt.param_groups) and kernels.skips_on_device(opt)
    assert kernels.kernel_options([*cpu, torch.zeros(2, dtype=torch.long)]) == {"foreach": True}
    assert kernels.kernel_options([*cpu, torch.zeros(2, device="meta")]) == {"foreach": True}


def test_fused_skips_on_the_device_and_steps_otherwise(monkeypatch):
    monkeypatch.setattr(kernels, "FUSED_DEVICE_TYPES", ("cpu",))
    params, twin = _params(), _params()
    opt, ref = (build_optimizer(ps, TrainConfig(lr=1e-2)) for ps in (params, twin))
    for ps in (params, twin):
        for p in ps:
            p.grad = torch.ones_like(p)
    kernels.step_unless(opt, torch.tensor(0.0))  # "not bad": a step
    ref.step()
    before = {k: [t.clone() for t in opt.state[p].values()] for k, p in enumerate(params)}
    weights = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, float("nan"))
    kernels.step_unless(opt, torch.tensor(1.0))  # "bad": the kernel leaves everything as it was
    assert all(torch.equal(p, w) for p, w in zip(params, weights))
    assert all(torch.equal(a, b) for k, p in enumerate(params) for a, b in zip(opt.state[p].values(), before[k]))
    assert opt.state[params[0]]["step"].item() == 1.0 and not hasattr(opt, "found_inf")
    for p, q in zip(params, twin):
        assert torch.equal(p, q)  # the step taken with found_inf = 0 is step() itself


def test_a_restored_step_count_lives_where_the_kernel_reads_it():
    p = nn.Parameter(torch.zeros(3, device="meta"))
    fused = type("Opt", (), {"param_groups": [{"params": [p], "fused": True}]})()
    loop = type("Opt", (), {"param_groups": [{"params": [p], "foreach": True}]})()
    on_device = kernels.step_count(fused, p, torch.tensor(7.0, dtype=torch.float64))
    assert on_device.device.type == "meta" and on_device.dtype == torch.float32 and on_device.shape == ()
    assert kernels.step_count(loop, p, 7).device.type == "cpu"


class _CountForeach(TorchFunctionMode):
    """Counts torch._foreach_lerp_ calls: AdamW's first-moment update, one per call of its multi-tensor path."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is torch._foreach_lerp_
        return func(*args, **(kwargs or {}))


def test_zero_steps_its_shard_in_one_call_per_group():
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)])
    _, opt = zero_parallel(model, make_mesh({}), 1, param_groups(model.parameters(), 0.1))
    segments = [p for g in opt.param_groups for p in g["params"]]
    assert len(segments) == 8 and all(g["foreach"] for g in opt.param_groups)
    for seg in segments:
        seg.grad.normal_()
    with _CountForeach() as counted:
        opt.step()
    assert counted.calls == 2  # the weights' group and the biases' group, not one per segment
