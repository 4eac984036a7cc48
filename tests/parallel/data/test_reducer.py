"""Data parallelism with the p2p all-reduce algorithms trains exactly like one process."""

import torch
from torch.testing import assert_close

from tessel.spawn import spawn
from tests.helpers import tiny_config, train_and_collect

# Same reasoning as tests/parallel/data/test_data_parallel.py: fp32 sums in another order give ulp-level
# gradient differences that AdamW magnifies a little over 10 steps; a wrong or missing
# shard moves losses at the 1e-2 level.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
WEIGHT_TOL = dict(rtol=1e-4, atol=2e-5)
LAYOUTS = {
    "ring": ["parallel.dp=4", "parallel.dp_algorithm=ring", "parallel.bucket_mb=0.01"],
    # two nodes of two ranks: intra ring, inter ring between same local ranks, intra gather
    "hierarchical": ["parallel.dp=4", "parallel.dp_algorithm=hierarchical", "parallel.bucket_mb=0.01",
                     "runtime.nnodes=2", "runtime.nproc_per_node=2"],
}


def _train_all():
    return {name: train_and_collect(tiny_config(*ov)) for name, ov in LAYOUTS.items()}


def test_ring_and_hierarchical_dp_match_single_process():
    reference = train_and_collect(tiny_config())
    assert reference["losses"][-1] < reference["losses"][0] - 0.2  # it learns, so parity means something
    for rank, runs in enumerate(spawn(_train_all, 4)):
        for name, got in runs.items():
            assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), **LOSS_TOL,
                         msg=lambda m: f"{name} rank {rank}: {m}")
            for key, ref in reference["state"].items():
                assert_close(got["state"][key], ref, **WEIGHT_TOL, msg=lambda m: f"{name} rank {rank} {key}: {m}")
