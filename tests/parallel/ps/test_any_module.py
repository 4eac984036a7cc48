"""The parameter server on a module a user brings (issue 17's defects 1 and 2).

One server, two BSP workers, a module with a frozen layer, a branch no worker calls and
a branch only the first worker calls, every rank built from its own seed:
- frozen weights and buffers start from the server's, like the trainable ones;
- the branch no worker used keeps its weights (AdamW neither decays it nor counts a step);
- the whole run equals DDP with find_unused_parameters on the two workers from the same
  start (BSP is the same mean of the two gradients and the same elementwise AdamW).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from torch.testing import assert_close

from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.spawn import spawn
from tests.parallel.zero.modules import Branchy, vector_batch

STEPS = 3


def _adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _loss(worker: int, step: int):
    x, y = vector_batch(step, worker)
    return lambda m: F.cross_entropy(m(pixel_values=x, use_extra=worker == 0), y)


def _bsp_then_ddp() -> dict:
    rank = dist.get_rank()
    workers = dist.new_group([1, 2])  # collective: every rank creates it
    torch.manual_seed(rank)  # each rank its own weights: the server's must win
    model = Branchy()
    ps = ParameterServer(model, servers=[0], workers=[1, 2], mode="bsp", optimizer=_adamw)
    init = {k: v.clone() for k, v in model.state_dict().items()}
    if ps.is_server:
        ps.serve()
        return {"init": init}
    for step in range(STEPS):
        ps.step(_loss(rank - 1, step))
    ps.finish()
    out = {"init": init, "ps": {k: v.clone() for k, v in model.state_dict().items()}}
    model.load_state_dict(init)
    model.zero_grad(set_to_none=True)
    ddp = DistributedDataParallel(model, process_group=workers, find_unused_parameters=True)
    opt = _adamw([p for p in model.parameters() if p.requires_grad])
    for step in range(STEPS):
        _loss(rank - 1, step)(ddp).backward()
        opt.step()
        opt.zero_grad()
    out["ddp"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def test_bsp_on_any_module_broadcasts_frozen_weights_and_skips_unused_ones():
    server, *workers = spawn(_bsp_then_ddp, 3)
    for rank, got in enumerate(workers, start=1):
        for name, w in server["init"].items():  # the server's weights everywhere, frozen ones too
            assert torch.equal(got["init"][name], w), f"rank {rank} {name}"
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(got["ps"][name], server["init"][name]), f"rank {rank}: {name} moved"
        assert not torch.equal(got["ps"]["extra.weight"], server["init"]["extra.weight"])
        for name, ref in got["ddp"].items():
            # the same arithmetic (mean of two gradients, elementwise AdamW on a flat shard vs on
            # each tensor); only vectorized-kernel rounding may differ, an ulp per step, as in
            # test_parameter_server.py
            assert_close(got["ps"][name], ref, rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"rank {rank} {n}: {m}")
