"""tessel.elastic.adaptive's pieces without a training run: a new process group of the ranks that stay, met in the job's
store through public torch.distributed calls, and which ranks an eviction takes."""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.elastic.adaptive import regroup, with_nodes_of, without_ranks
from tessel.spawn import spawn
from tessel.train.fault.slow import evicted_with
from tests.helpers import tiny_config

ROOT = Path(__file__).resolve().parents[2]


def _regroup_twice() -> dict:
    """3 ranks leave rank 1 out, then (as 2) their new rank 1: two new groups in the same job's store."""
    start = dist.get_rank()
    worlds = []
    for evicted in ([1], [1]):
        if not regroup(evicted, timeout_s=60):
            return {"start": start, "evicted": True, "worlds": worlds}
        total = torch.tensor([float(start)])
        dist.all_reduce(total)  # the new group works: the survivors' start ranks, summed
        worlds.append((dist.get_rank(), dist.get_world_size(), total.item()))
    return {"start": start, "evicted": False, "worlds": worlds}


def test_regroup_forms_new_groups_of_the_ranks_that_stay():
    got = spawn(_regroup_twice, 3, timeout=120)
    assert [g["evicted"] for g in got] == [False, True, True]
    # rank 1 leaves first: 0 and 2 become 0 and 1 (their start ranks sum to 2); then the new rank 1 (start 2)
    assert got[0]["worlds"] == [(0, 2, 2.0), (0, 1, 0.0)]
    assert got[2]["worlds"] == [(1, 2, 2.0)] and got[1]["worlds"] == []


def test_tessel_calls_no_private_torch_distributed_function():
    """A private function (`_get_default_store`, ...) may change or vanish in any torch release."""
    private = re.compile(r"\b(?:dist|distributed_c10d|c10d)\._[a-z]\w*\(")
    hits = [f"{p.relative_to(ROOT)}:{i}: {line.strip()}" for p in sorted((ROOT / "tessel").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if private.search(line)]
    assert hits == []


def test_eviction_takes_the_slow_ranks_node_or_the_rank_alone_on_one_node():
    two_nodes = tiny_config("parallel.dp=4", "runtime.nnodes=2", "runtime.nproc_per_node=2",
                            "runtime.device_speeds=[1.0, 2.0, 3.0, 4.0]")
    assert evicted_with(two_nodes, 4, 3)[0] == [2, 3] and evicted_with(two_nodes, 4, 0)[0] == [0, 1]
    one_node = tiny_config("parallel.dp=4")
    leave, why = evicted_with(one_node, 4, 3)
    assert leave == [3] and "alone" in why
    # the ranks left keep their declarations, renumbered, and their node size where whole nodes left
    left = without_ranks(two_nodes, [0, 1])
    assert left.runtime.device_speeds == [3.0, 4.0] and (left.runtime.nnodes, left.runtime.nproc_per_node) == (1, 2)
    assert without_ranks(one_node, [3]).runtime.nproc_per_node is None
    # a re-plan clears the node size; where whole nodes left it still holds, and a later eviction needs it
    replanned = tiny_config("parallel.dp=2")
    assert with_nodes_of(left, replanned, None)[0].runtime.nproc_per_node == 2
    assert with_nodes_of(two_nodes, replanned, None)[0].runtime.nproc_per_node is None  # 2 x 2 is not 2 ranks
