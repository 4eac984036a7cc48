"""Every torch.distributed call one training step issues, recorded as (op, group, bytes): the runtime side of
tests/planner/test_traffic_matches_runtime.py (the planner's call lists against a real step) and of the grid
modes' traffic test (tests/parallel/tensor_nd/test_grid_modes.py)."""

from __future__ import annotations

import functools
import inspect
import itertools
import sys

import torch
import torch.distributed as dist

from tessel.axes import AXES
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
