"""ZeRO on modules a user brings (issue 17's defects), against DDP and FSDP2 at dp=2.

One spawn runs every scenario; the tests below read its results:
- unused parameters: a branch no rank calls keeps grad None (AdamW neither decays it nor
  counts its step), a branch one rank calls gets the reduced gradient on both, as under
  DDP with find_unused_parameters;
- frozen parameters: broadcast from the first rank like the trainable ones (ranks start
  from different seeds), and cast to param_dtype under bf16 storage;
- bf16 storage with inputs passed by keyword and a frozen layer, against FSDP2's
  MixedPrecisionPolicy;
- a ResNet (BatchNorm, nn.Sequential stages, no nn.ModuleList): stage 3 finds its blocks
  as units, and with broadcast_buffers every stage equals DDP with broadcast_buffers,
  buffers included;
- a stage-3 parameter read outside gathered() is a Python error; state_dict() gathers.

Tolerance: none. Both ranks compute the same forward and backward on the same weights,
a gradient is the sum of two ranks' (a + b == b + a in any collective) divided by 2
(exact), and AdamW is elementwise: ZeRO's segments must end bit for bit where DDP's
(or FSDP2's) whole parameters do.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from tessel.mesh import make_mesh
from tessel.parallel.zero.flat import find_units, size_based_units
from tessel.parallel.zero.zero_parallel import zero_parallel
from tessel.spawn import spawn
from tests.parallel.zero.modules import Branchy, TinyResNet, image_batch, vector_batch
from tests.parallel.zero.references import BF16, HYPER, ddp, fp32_weights, fsdp, groups_of, zero

STEPS = 3


def _stepped(kind: str, net: nn.Module, opt) -> dict[str, bool]:
    """Whether AdamW holds state (has stepped) for each trainable parameter."""
    if kind.startswith("zero"):
        keys = opt.checkpoint_tensors()
        return {n: f"optim/{n}/step" in keys for n, p in net.named_parameters() if p.requires_grad}
    return {n: bool(opt.state.get(p)) for n, p in net.named_parameters() if p.requires_grad}


def _train(kind: str, net: nn.Module, model, opt, batch, use_extra: bool) -> dict:
    rank = dist.get_rank()
    grads_none = {}
    for step in range(STEPS):
        x, y = batch(step, rank)
        out = model(pixel_values=x, **({"use_extra": use_extra} if isinstance(net, Branchy) else {}))
        F.cross_entropy(out.float(), y).backward()
        if kind == "ddp":
            grads_none = {n: p.grad is None for n, p in net.named_parameters() if p.requires_grad}
        opt.step()
        opt.zero_grad()
    return {"weights": fp32_weights(kind, net, model, opt), "stepped": _stepped(kind, net, opt),
            "grads_none": grads_none}


def _branchy_runs() -> dict:
    """Ranks start from different seeds (DDP and ZeRO broadcast the first rank's weights,
    frozen ones included); rank 0 alone calls the `extra` branch."""
    rank, out = dist.get_rank(), {}
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        torch.manual_seed(rank)
        net = Branchy()
        model, opt = ddp(net, find_unused_parameters=True) if kind == "ddp" else zero(net, int(kind[-1]))
        out[kind] = _train(kind, net, model, opt, vector_batch, use_extra=rank == 0)
        if kind == "zero3":
            out["outside_gathered"] = _read_outside_gathered(net)
            with model.gathered():
                inside = {k: v.detach().clone() for k, v in net.state_dict().items()}
            outside = net.state_dict()
            out["state_dict_gathers"] = (outside.keys() == inside.keys()
                                         and all(torch.equal(outside[k], v) for k, v in inside.items()))
    return out


def _read_outside_gathered(net: nn.Module) -> list[str]:
    errors = []
    for read in (lambda: str(net.blocks[0].weight), lambda: net.blocks[0].weight.detach().sum().item(),
                 lambda: net.blocks[0].weight.cpu(), lambda: net.head.bias + 1):
        try:
            read()
            errors.append("no error")
        except RuntimeError as err:
            errors.append(str(err))
    return errors


def _bf16_runs() -> dict:
    """bf16 storage, the input by keyword, a frozen layer: FSDP2's MixedPrecisionPolicy is the
    reference (every rank from seed 0: FSDP2 broadcasts nothing; no rank-dependent branch:
    FSDP2 reduce-scatters only the parameters that have a gradient on every rank)."""
    out = {}
    for kind in ("fsdp", "zero1", "zero2", "zero3"):
        torch.manual_seed(0)
        net = Branchy()
        model, opt = fsdp(net, list(net.blocks), mixed=True) if kind == "fsdp" else zero(net, int(kind[-1]), True)
        out[kind] = _train(kind, net, model, opt, vector_batch, use_extra=False)
        if kind != "fsdp":
            out[kind]["frozen_dtype"] = net.frozen.weight.dtype
    return out


def _resnet_runs() -> dict:
    """BatchNorm buffers broadcast from the first rank before every training forward, as DDP's
    broadcast_buffers; ranks start from different seeds and see different images."""
    rank, out = dist.get_rank(), {}
    for kind in ("ddp", "zero1", "zero2", "zero3"):
        torch.manual_seed(rank)
        net = TinyResNet()
        if kind == "ddp":
            model, opt = ddp(net, broadcast_buffers=True)
        else:
            model, opt = zero(net, int(kind[-1]), broadcast_buffers=True)
        if kind == "zero3":
            out["units"] = [u is b for u, b in zip(model.placement.unit_modules, net.blocks())]
            out["gathered_in_blocks"] = _count_gathered(model, net)
        out[kind] = _train(kind, net, model, opt, image_batch, use_extra=False)
    return out


def _count_gathered(model, net) -> list[tuple[int, int]]:
    """(flat groups gathered, all flat groups) when each block starts its forward."""
    seen = []
    for block in net.blocks():
        block.register_forward_hook(lambda *_: seen.append((sum(g.gathered for g in model.groups), len(model.groups))))
    return seen


def _all_runs():
    return {"branchy": _branchy_runs(), "bf16": _bf16_runs(), "resnet": _resnet_runs()}


@pytest.fixture(scope="module")
def runs():
    return spawn(_all_runs, 2)


def _assert_same(got: dict, want: dict, where: str) -> None:
    assert got.keys() == want.keys(), where
    for name, w in want.items():
        assert torch.equal(got[name], w), f"{where} {name}: max diff {(got[name].float() - w.float()).abs().max()}"


def test_unused_parameters_keep_no_gradient_like_ddp(runs):
    for rank, run in enumerate(runs):
        ref = run["branchy"]["ddp"]
        assert ref["grads_none"]["unused.weight"] and not ref["grads_none"]["extra.weight"]
        assert not ref["stepped"]["unused.weight"] and ref["stepped"]["extra.weight"]
        for stage in (1, 2, 3):
            got = run["branchy"][f"zero{stage}"]
            assert got["stepped"] == ref["stepped"], f"rank {rank} stage {stage}"
            _assert_same(got["weights"], ref["weights"], f"rank {rank} stage {stage}")
    # the same start everywhere (frozen weights included), whatever each rank's seed
    _assert_same(runs[1]["branchy"]["zero3"]["weights"], runs[0]["branchy"]["zero3"]["weights"], "ranks")


def test_bf16_storage_casts_keyword_inputs_and_frozen_parameters_like_fsdp2(runs):
    for rank, run in enumerate(runs):
        ref = run["bf16"]["fsdp"]
        for stage in (1, 2, 3):
            got = run["bf16"][f"zero{stage}"]
            assert got["frozen_dtype"] == BF16
            # the trainable weights are fp32 masters on both sides; a frozen one computes in bf16
            # on both, but only FSDP2 keeps its fp32 original (ZeRO keeps no fp32 copy of what
            # never steps)
            want = {k: w.to(BF16) if k.startswith("frozen.") else w for k, w in ref["weights"].items()}
            _assert_same(got["weights"], want, f"rank {rank} stage {stage}")


def test_resnet_stage3_units_and_broadcast_buffers_match_ddp(runs):
    for rank, run in enumerate(runs):
        res = run["resnet"]
        assert res["units"] == [True] * 4, "stage 3 units: the four BasicBlocks"
        # at most the root, the running block and the prefetched next one are whole
        assert res["gathered_in_blocks"] and all(n <= 3 < total for n, total in res["gathered_in_blocks"])
        for stage in (1, 2, 3):
            _assert_same(res[f"zero{stage}"]["weights"], res["ddp"]["weights"], f"rank {rank} stage {stage}")
    buffers = [k for k in runs[0]["resnet"]["ddp"]["weights"] if "running" in k]
    assert buffers and any(not torch.equal(runs[0]["resnet"]["ddp"]["weights"][k], runs[1]["resnet"]["ddp"]["weights"][k])
                           for k in buffers), "the last forward updates each rank's buffers apart"


def test_stage3_parameter_outside_gathered_is_a_python_error(runs):
    for run in runs:
        errors = run["branchy"]["outside_gathered"]
        assert all("gathered()" in e for e in errors), errors
        assert run["branchy"]["state_dict_gathers"]


def test_find_units_in_any_module():
    net = TinyResNet()
    assert [id(u) for u in find_units(net)] == [id(b) for b in net.blocks()]
    stack = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)))
    assert [id(u) for u in find_units(stack)] == [id(stack[0]), id(stack[2])]
    assert find_units(nn.Linear(2, 2)) == []


def test_size_based_units_claim_bottom_up():
    """A BasicBlock of the first stage holds 1184 parameters, each convolution of the second
    stage 1152 or 2304: at 1100 the first stage's blocks become units whole, the second stage's
    convolutions alone, and what is left (norms, downsample, stem, head) stays in the root."""
    net = TinyResNet()
    names = {id(m): n for n, m in net.named_modules()}
    assert [names[id(u)] for u in size_based_units(net, 1100)] == [
        "layer1.0", "layer1.1", "layer2.0.conv1", "layer2.0.conv2", "layer2.1.conv1", "layer2.1.conv2"]
    assert size_based_units(net, sum(p.numel() for p in net.parameters()) + 1) == []


@pytest.mark.parametrize("stage,mixed", [(1, True), (2, False), (3, False), (3, True)])
def test_load_state_dict_reaches_the_fp32_masters(stage, mixed):
    """load_state_dict writes the loaded values into the optimizer's fp32 masters exactly (under
    bf16 storage the module's copy is their rounding), so the next step starts from them."""
    torch.manual_seed(0)
    net, source = Branchy(), Branchy()
    dtypes = {"param_dtype": BF16, "reduce_dtype": torch.float32} if mixed else {}
    model, opt = zero_parallel(net, make_mesh({"dp": 1}), stage, groups_of(net), **HYPER, **dtypes)
    model.load_state_dict({f"module.{k}": v for k, v in source.state_dict().items()})
    masters = {k.removeprefix("model/"): v for k, v in opt.checkpoint_tensors().items() if k.startswith("model/")}
    for name, want in source.state_dict().items():
        if name in masters:
            assert torch.equal(masters[name], want), name
    with model.gathered():
        for name, got in net.state_dict().items():
            assert torch.equal(got, source.state_dict()[name].to(got.dtype)), name
