"""Bytes on the wire per layer for each tensor-parallel mode, measured: a recorder on the collectives.

The theory (bytes a rank sends per linear layer in each mode, and why) is tessel.planner.tp_grid's
linear_bytes, pure arithmetic the planner can use; CollectiveRecorder measures the runtime's collectives
so that tests/parallel/tensor_nd can hold the two against each other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tessel.parallel.tensor import comm


class CollectiveRecorder:
    """Counts the bytes this rank sends in torch.distributed collectives while `recording()` is open.

    A measuring tool (tests, benchmarks): for the duration it wraps the collectives tessel's tensor
    parallelism calls (torch.distributed's broadcast, reduce, all_reduce, and the single-tensor
    all-gather / reduce-scatter that tessel.parallel.tensor.comm bound at import) and restores them on exit.
    """

    def __init__(self):
        self.sent = 0.0
        self.calls: list[tuple[str, int, int]] = []  # (collective, payload bytes, group size)

    def _count(self, name: str, payload: torch.Tensor, group, factor: float) -> None:
        n = dist.get_world_size(group)
        b = payload.numel() * payload.element_size()
        self.calls.append((name, b, n))
        self.sent += factor * (n - 1) / n * b

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveRecorder]:
        saved = {name: getattr(dist, name) for name in ("broadcast", "reduce", "all_reduce")}
        gather, scatter = comm._all_gather_single, comm._reduce_scatter_single

        def wrap(name, fn, factor, payload_of):
            def recorded(*args, group=None, **kw):
                self._count(name, payload_of(args), group, factor)
                return fn(*args, group=group, **kw)
            return recorded

        def first(args):  # the payload argument of most collectives
            return args[0]

        try:
            dist.broadcast = wrap("broadcast", saved["broadcast"], 1, first)
            dist.reduce = wrap("reduce", saved["reduce"], 1, first)
            dist.all_reduce = wrap("all_reduce", saved["all_reduce"], 2, first)
            comm._all_gather_single = wrap("all_gather", gather, 1, first)  # (output, input): the whole
            comm._reduce_scatter_single = wrap("reduce_scatter", scatter, 1, lambda args: args[1])  # the input
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            comm._all_gather_single, comm._reduce_scatter_single = gather, scatter

