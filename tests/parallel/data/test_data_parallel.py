"""Data parallelism: parity with one process, and the library API on a plain module."""

import torch
import torch.nn as nn
from torch.testing import assert_close

from tessel.mesh import make_mesh
from tessel.parallel.data.data_parallel import data_parallel
from tessel.spawn import spawn
from tests.helpers import tiny_config, train_and_collect

# fp32 throughout. The all-reduce sums the shards' gradients in another order
# than one process does, so gradients differ by a few ulps (~1e-7 relative);
# AdamW divides by sqrt(v) and magnifies that where gradients are tiny, and 10
# steps compound it. Measured differences stay below 2e-6; the tolerances
# leave an order of magnitude of room, far below any real bug (a missing or
# doubled shard changes losses at the 1e-2 level).
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=2e-5)


def _train(overrides):
    return train_and_collect(tiny_config(*overrides))


def _check_parity(world, overrides):
    reference = _train([])
    results = spawn(_train, world, [f"parallel.dp={world}", *overrides])
    for rank, got in enumerate(results):
        assert len(got["losses"]) == 10
        assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), **LOSS_TOL)
        for name, ref in reference["state"].items():
            assert_close(got["state"][name], ref, **WEIGHT_TOL, msg=lambda m: f"rank {rank} {name}: {m}")
    # the run must actually learn, or parity would be trivially true
    assert reference["losses"][-1] < reference["losses"][0] - 0.2


def test_dp2_matches_single_process():
    _check_parity(2, [])


def test_dp4_with_grad_accumulation_matches_single_process():
    _check_parity(4, ["train.grad_accum=2", "parallel.bucket_mb=0.01"])


def _plain_module_step(seed_offset):
    rank = torch.distributed.get_rank()
    torch.manual_seed(rank + seed_offset)  # different init per rank: broadcast must fix it
    mesh = make_mesh({"dp": torch.distributed.get_world_size()})
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    model = data_parallel(net, mesh, bucket_mb=1e-4)  # tiny buckets: several in flight
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank))
    with model.no_sync():
        model(x).pow(2).sum().backward()
    model(x * 2).pow(2).sum().backward()
    return {n: p.grad.clone() for n, p in net.named_parameters()}, {n: p.detach().clone() for n, p in net.named_parameters()}


def test_data_parallel_any_module_averages_accumulated_grads():
    results = spawn(_plain_module_step, 2, 0)
    grads0, weights0 = results[0]
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    net.load_state_dict(weights0)
    for rank in range(2):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank))
        (net(x).pow(2).sum() / 2).backward()
        (net(x * 2).pow(2).sum() / 2).backward()
    for rank, (grads, weights) in enumerate(results):
        for n, p in net.named_parameters():
            assert_close(weights[n], p.detach())  # broadcast: bitwise the same start
            # summation order differs (all-reduce vs sequential): fp32 ulps only
            assert_close(grads[n], p.grad, rtol=1e-5, atol=1e-6)
