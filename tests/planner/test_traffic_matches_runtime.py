"""The planner's call list (tessel.planner.traffic) against the collectives a real step issues, call by call.

Each layout runs the tiny reference GPT on 2 processes, as `tessel train` builds it; after one
warm-up step (set-up traffic: process groups, first buffers) every torch.distributed call of the
next step is recorded (op, group, bytes) and compared with CostModel.step_calls, which the planner
builds from traffic.py's lists for the same layout and model: the same ops on the same groups, of
the same sizes, as many times (a multiset: the order of independent calls means nothing). The
list includes the trainer's scalar collectives that the planner prices through its measured
overhead rather than call by call (traffic.trainer_calls), so nothing a step issues goes unchecked.
"""

from __future__ import annotations

import collections

import pytest

from tessel.axes import TOKEN_AXES
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import from_config
from tessel.spawn import spawn
from tests.helpers import tiny_config
from tests.planner.recorder import record_step

LAYOUTS = {  # the tiny GPT: 2 blocks, d_model 32, vocab 256; 8 sequences of 16 tokens per step
    "tp2_sp": ["parallel.tp=2", "parallel.sequence_parallel=true"],
    "zero2_dp2": ["parallel.dp=2", "parallel.zero_stage=2"],
    "pp2_1f1b": ["parallel.pp=2", "parallel.micro_batches=4", 'parallel.schedule="1f1b"'],
    # two accumulation steps: see test_zero2_with_accumulation_reduces_once_per_step
    "zero2_dp2_ga2": ["parallel.dp=2", "parallel.zero_stage=2", "train.grad_accum=2"],
    "cp2_ring": ["parallel.cp=2"],
    "cp2_ulysses": ["parallel.cp=2", 'parallel.cp_mode="ulysses"'],
}


def record_all() -> dict[str, dict]:
    """One rank: every layout in turn (one start-up of the processes for all of them)."""
    return {name: record_step(overrides) for name, overrides in LAYOUTS.items()}


@pytest.fixture(scope="module")
def recorded() -> list[dict[str, dict]]:
    return spawn(record_all, 2, timeout=300)


def planned(name: str, stage: int) -> collections.Counter:
    """traffic's list for one rank of `name`'s layout, keyed like the recorder's calls."""
    cfg = tiny_config(*LAYOUTS[name])
    lay = config_layout(cfg)
    cost = CostModel(from_config(cfg.model, cfg.train.seq_len, cfg.train.global_batch), get_cluster("a100"),
                     cfg.train.precision, bucket_mb=cfg.parallel.bucket_mb)
    # the planner's group names as the recorder names the runtime's groups
    dp = "+".join(a for a in TOKEN_AXES if getattr(lay, a) > 1)
    label = {"tp": "tp", "pp": "pp", "ep": "ep", "dp": dp, "world": "world", "cp": "cp"}
    out = collections.Counter()
    for group, calls in cost.step_calls(lay, stage).items():
        for c in calls:
            assert c.count == int(c.count) and c.nbytes == int(c.nbytes), c
            # a ring hop is one isend and one irecv at once: the runtime issues both, the planner prices the hop
            hop = 2 if group == "cp" and c.op == "p2p" else 1
            out[c.op, label[group], int(c.nbytes)] += int(c.count) * hop
    return out


def assert_same_calls(recorded, name: str) -> None:
    for rank, runs in enumerate(recorded):
        run = runs[name]
        got, want = collections.Counter(tuple(c) for c in run["calls"]), planned(name, run["stage"])
        assert got == want, (f"{name}, rank {rank}: runtime only {dict(got - want)}, "
                             f"planner only {dict(want - got)}")


def test_tp2_sequence_parallel_step(recorded):
    """Per block: all-gather in and reduce-scatter out of attention and MLP, mirrored in backward, and
    the two norm weights' gradients summed; the embedding, head and vocab-parallel loss at the edges;
    the gradient norm's partial sum over tp."""
    assert_same_calls(recorded, "tp2_sp")


def test_zero2_step(recorded):
    """One 25 MiB bucket holds the tiny model: one reduce-scatter of it, one all-gather of the updated
    shards; the gradient norm's partial sum over the ZeRO shards."""
    assert_same_calls(recorded, "zero2_dp2")


def test_pp2_1f1b_step(recorded):
    """4 micro-batches: each stage sends or receives every activation and its gradient once (8
    messages); the loss message from the last stage, the bubble metrics, the norm over pp."""
    assert_same_calls(recorded, "pp2_1f1b")


def test_zero2_with_accumulation_reduce_scatters_every_micro_batch(recorded):
    """ZeRO-2 keeps gradients sharded through accumulation, as its memory table and the planner say."""
    assert_same_calls(recorded, "zero2_dp2_ga2")


def test_cp2_ring_step(recorded):
    """Per block: the key/value block's one hop forward; backward its hop again and its fp32 gradient's two
    (the last one home); the gradient all-reduce and the loss's mean over cp, which sees different tokens."""
    assert_same_calls(recorded, "cp2_ring")


def test_cp2_ulysses_step(recorded):
    """Per block: q, k, v to the head split and the output back, each one all-to-all, mirrored in backward."""
    assert_same_calls(recorded, "cp2_ulysses")
