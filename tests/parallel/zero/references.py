"""The any-module tests' wrappers of one module for DP and ZeRO (issue 17): DDP, FSDP2 and tessel's ZeRO, with
the same AdamW groups and hyper-parameters, and their fp32 weights read back whole. Shared by the ZeRO, DP and
Hugging Face any-module tests (tests/parallel/{zero,data}/test_*.py)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import make_mesh
from tessel.parallel.zero.zero_parallel import zero_parallel

HYPER = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
BF16 = torch.bfloat16


def groups_of(module: nn.Module) -> list[dict]:
    """AdamW groups over the trainable parameters: decay on matrices only."""
    params = [p for p in module.parameters() if p.requires_grad]
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": HYPER["weight_decay"]},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def ddp(net: nn.Module, **kw):
    from torch.nn.parallel import DistributedDataParallel
    model = DistributedDataParallel(net, **kw)
    return model, torch.optim.AdamW(groups_of(net), lr=HYPER["lr"], betas=HYPER["betas"])


def fsdp(net: nn.Module, units, mixed: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    return net, torch.optim.AdamW(groups_of(net), lr=HYPER["lr"], betas=HYPER["betas"])


def zero(net: nn.Module, stage: int, mixed: bool = False, **kw):
    dtypes = dict(param_dtype=BF16, reduce_dtype=torch.float32) if mixed else {}
    return zero_parallel(net, make_mesh({"dp": dist.get_world_size()}), stage, groups_of(net), **HYPER,
                         bucket_mb=1e-4, **dtypes, **kw)


def fp32_weights(kind: str, net: nn.Module, model, opt) -> dict[str, torch.Tensor]:
    """The fp32 weights (ZeRO: its masters; FSDP2: its sharded fp32 parameters, whole) and buffers."""
    if kind.startswith("zero"):
        out = {k.removeprefix("model/"): v for k, v in opt.checkpoint_tensors().items() if k.startswith("model/")}
        with model.gathered():
            out.update({k: v.detach().clone() for k, v in net.state_dict().items() if k not in out})
        return out
    if kind.startswith("fsdp"):
        return {k: v.full_tensor().detach().clone() for k, v in net.state_dict().items()}
    return {k: v.detach().clone() for k, v in net.state_dict().items()}
