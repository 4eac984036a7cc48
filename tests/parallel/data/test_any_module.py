"""Data parallelism on modules a user brings (issue 17's defects), against DDP at dp=2.

- unused parameters: a branch no rank calls keeps grad None on both ranks (AdamW
  neither decays it nor counts its step), a branch one rank calls gets the reduced
  gradient on both, as DDP with find_unused_parameters; also when the branch is
  called in an accumulation micro-step (no_sync) only;
- broadcast_buffers: a ResNet's BatchNorm statistics follow the first rank's before
  every training forward when on (the default, as DDP's) and stay each rank's own
  when off, exactly as under DDP with the same setting.

Tolerance: none. Both ranks compute the same forward and backward on the same weights,
a gradient is the sum of two ranks' (a + b == b + a) divided by 2 (exact), and AdamW
is the same elementwise code on the same tensors: tessel must end bit for bit where
DDP does, buffers included.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from tessel.mesh import make_mesh
from tessel.parallel.data.data_parallel import data_parallel
from tessel.spawn import spawn
from tests.parallel.zero.modules import Branchy, TinyResNet, image_batch, vector_batch
from tests.parallel.zero.references import HYPER, groups_of

STEPS = 3


def _wrap(kind: str, net, **kw):
    if kind == "ddp":
        return DistributedDataParallel(net, **kw)
    kw.pop("find_unused_parameters", None)  # tessel finds them always
    return data_parallel(net, make_mesh({"dp": dist.get_world_size()}), bucket_mb=1e-4, **kw)


def _train(kind: str, net, batch, micro_steps: int, use_extra, **kw) -> dict:
    """`use_extra(micro_step)`: whether this rank calls Branchy's extra branch then."""
    rank = dist.get_rank()
    model = _wrap(kind, net, **kw)
    opt = torch.optim.AdamW(groups_of(net), lr=HYPER["lr"], betas=HYPER["betas"])
    grads_none = []
    for step in range(STEPS):
        x, y = batch(step, rank)
        for m, (xc, yc) in enumerate(zip(x.chunk(micro_steps), y.chunk(micro_steps))):
            extra = {"use_extra": use_extra(m)} if isinstance(net, Branchy) else {}
            with model.no_sync() if m < micro_steps - 1 else contextlib.nullcontext():
                F.cross_entropy(model(pixel_values=xc, **extra), yc).backward()
        grads_none.append({n: p.grad is None for n, p in net.named_parameters() if p.requires_grad})
        opt.step()
        opt.zero_grad()
    return {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()}, "grads_none": grads_none,
            "stepped": {n: bool(opt.state.get(p)) for n, p in net.named_parameters() if p.requires_grad}}


def _runs() -> dict:
    rank, out = dist.get_rank(), {}
    cases = {"branchy": (Branchy, vector_batch, 1, lambda m: rank == 0, dict(find_unused_parameters=True)),
             # the extra branch runs in the first (no_sync) micro-step of rank 0 only
             "branchy-accum": (Branchy, vector_batch, 2, lambda m: rank == 0 and m == 0,
                               dict(find_unused_parameters=True)),
             "resnet-broadcast": (TinyResNet, image_batch, 1, None, dict(broadcast_buffers=True)),
             "resnet-local": (TinyResNet, image_batch, 1, None, dict(broadcast_buffers=False))}
    for case, (cls, batch, micro_steps, use_extra, kw) in cases.items():
        for kind in ("ddp", "tessel"):
            torch.manual_seed(rank)  # different on each rank: both broadcast the first rank's at wrap time
            out[case, kind] = _train(kind, cls(), batch, micro_steps, use_extra, **kw)
    return out


@pytest.fixture(scope="module")
def runs():
    return spawn(_runs, 2)


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{where} {name}: max diff {(got[name] - w).abs().max()}"


@pytest.mark.parametrize("case", ["branchy", "branchy-accum"])
def test_unused_parameters_keep_no_gradient_like_ddp(runs, case):
    for rank, run in enumerate(runs):
        ref, got = run[case, "ddp"], run[case, "tessel"]
        assert all(g["unused.weight"] and not g["extra.weight"] for g in ref["grads_none"])
        assert got["grads_none"] == ref["grads_none"], f"rank {rank}"
        assert got["stepped"] == ref["stepped"] and not got["stepped"]["unused.weight"]
        _assert_same(got["weights"], ref["weights"], f"rank {rank} {case}")


@pytest.mark.parametrize("case", ["resnet-broadcast", "resnet-local"])
def test_broadcast_buffers_like_ddp(runs, case):
    for rank, run in enumerate(runs):
        _assert_same(run[case, "tessel"]["weights"], run[case, "ddp"]["weights"], f"rank {rank} {case}")
    # the setting matters on the second rank: the first rank's statistics before each step, or its own
    mean = "bn1.running_mean"
    assert not torch.equal(runs[1]["resnet-broadcast", "tessel"]["weights"][mean],
                           runs[1]["resnet-local", "tessel"]["weights"][mean])
