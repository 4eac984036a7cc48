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
import functools
import inspect
import itertools
import sys

import pytest
import torch
import torch.distributed as dist

from tessel.axes import AXES, TOKEN_AXES
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import from_config
from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config

# op names as the planner prices them; sizes by traffic.py's convention (all_reduce the buffer,
# all_gather the gathered output, reduce_scatter the whole input, all_to_all one rank's send
# buffer, p2p one message)
RECORDED = {
    "all_reduce": ("all_reduce", lambda t, *a, **k: t),
    "all_gather_single": ("all_gather", lambda out, inp, *a, **k: out),
    "all_gather_into_tensor": ("all_gather", lambda out, inp, *a, **k: out),
    "reduce_scatter_single": ("reduce_scatter", lambda out, inp, *a, **k: inp),
    "reduce_scatter_tensor": ("reduce_scatter", lambda out, inp, *a, **k: inp),
    "all_to_all_single": ("all_to_all", lambda out, inp, *a, **k: inp),
    "broadcast": ("broadcast", lambda t, *a, **k: t),
    "isend": ("p2p", lambda t, *a, **k: t),
    "irecv": ("p2p", lambda t, *a, **k: t),
    "send": ("p2p", lambda t, *a, **k: t),
    "recv": ("p2p", lambda t, *a, **k: t),
    # anything else a step issues is recorded by name, so that it cannot pass unseen
    "all_gather": ("all_gather_list", lambda out, t, *a, **k: t),
    "all_gather_object": ("all_gather_object", lambda *a, **k: None),
    "broadcast_object_list": ("broadcast_object_list", lambda *a, **k: None),
    "reduce_scatter": ("reduce_scatter_list", lambda out, ins, *a, **k: out),
    "all_to_all": ("all_to_all_list", lambda outs, ins, *a, **k: ins[0]),
    "barrier": ("barrier", lambda *a, **k: None),
    "reduce": ("reduce", lambda t, *a, **k: t),
    "gather": ("gather", lambda t, *a, **k: t),
    "scatter": ("scatter", lambda t, *a, **k: t),
}


class Recorder:
    """Wraps the torch.distributed functions tessel calls; each call is (op, group, bytes).

    Groups are named by the mesh axes whose process group they are ("tp", "dp", ...; "world" for
    the default group), others by their size. Module-level aliases of the functions (such as
    tessel.parallel.tensor.comm._all_gather_single) are rebound too. batch_isend_irecv records
    each of its P2POps and hands torch the original isend/irecv, which it tells apart by identity.
    """

    def __init__(self, mesh):
        self.calls: list[tuple[str, str, int]] = []
        self.names = {}  # id(process group) -> the axes of size > 1 it spans, joined by "+"
        for n in range(1, len(AXES) + 1):
            for axes in itertools.permutations(AXES, n):
                try:
                    group = mesh.group(*axes)
                except KeyError:  # never built: nothing uses it
                    continue
                if group is not None:
                    self.names.setdefault(id(group), "+".join(a for a in AXES if a in axes and mesh.size(a) > 1))
        self.originals = {name: getattr(dist, name) for name in [*RECORDED, "batch_isend_irecv"]
                          if hasattr(dist, name)}
        self.patched: list[tuple[object, str, object]] = []

    def group_name(self, group) -> str:
        if group is None or group is dist.GroupMember.WORLD:
            return "world"
        return self.names.get(id(group), f"group{dist.get_world_size(group)}")

    def wrap(self, name: str):
        original = self.originals[name]
        op, buffer = RECORDED[name]
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            t = buffer(*args, **kwargs)
            nbytes = t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0
            group = signature.bind(*args, **kwargs).arguments.get("group")  # by keyword or by position
            self.calls.append((op, self.group_name(group), nbytes))
            return original(*args, **kwargs)
        return recorded

    def batch(self, ops):
        for p in ops:
            self.calls.append(("p2p", self.group_name(p.group), p.tensor.numel() * p.tensor.element_size()))
        return self.originals["batch_isend_irecv"](ops)

    def p2p_op(self, op, *args, **kwargs):
        """torch checks a P2POp's op by identity: it gets the original isend/irecv back."""
        return self.original_p2p_op(self.unwrapped.get(op, op), *args, **kwargs)

    def __enter__(self):
        self.wrapped = {name: self.wrap(name) for name in self.originals if name in RECORDED}
        self.unwrapped = {w: self.originals[n] for n, w in self.wrapped.items()}
        self.original_p2p_op = dist.P2POp
        replacement = {id(self.originals[n]): w for n, w in self.wrapped.items()}
        replacement[id(self.originals["batch_isend_irecv"])] = self.batch
        replacement[id(dist.P2POp)] = self.p2p_op
        modules = [dist] + [m for name, m in sys.modules.items() if name.startswith("tessel") and m is not None]
        for module in modules:
            for attr, value in list(vars(module).items()):
                if callable(value) and id(value) in replacement:
                    self.patched.append((module, attr, value))
                    setattr(module, attr, replacement[id(value)])
        return self

    def __exit__(self, *exc):
        for module, attr, value in reversed(self.patched):
            setattr(module, attr, value)


def record_step(overrides: list[str]) -> dict:
    """One rank: build what `tessel train` builds, run a warm-up step, record the next one."""
    cfg = tiny_config(*overrides)
    trainer, _, _, mesh = build_trainer(cfg)
    trainer.train_step(0)  # set-up traffic (groups, first buffers) stays out of the record
    with Recorder(mesh) as rec:
        trainer.train_step(1)
    return {"calls": rec.calls, "stage": mesh.local_rank_in("pp") if mesh.size("pp") > 1 else 0}


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
