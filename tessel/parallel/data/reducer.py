"""Gradient reducers for DataParallel from the p2p algorithms (config parallel.dp_algorithm)."""

from __future__ import annotations

import concurrent.futures as cf
from typing import Callable, Sequence

import torch

from tessel.comm.algorithms import hierarchical_all_reduce, ring_all_reduce
from tessel.comm.topology import resolve_nodes
from tessel.config import RuntimeConfig
from tessel.parallel.data.data_parallel import native_all_reduce


class Deferred:
    """A work handle whose wait() joins (or runs) a p2p algorithm."""

    def __init__(self, future: cf.Future | None = None, run: Callable[[], object] | None = None):
        self.future, self.run = future, run

    def wait(self) -> bool:
        if self.future is not None:
            self.future.result()  # re-raises the algorithm's error here, on the training thread
        elif self.run is not None:
            self.run()
            self.run = None
        return True


class AlgorithmReducer:
    """reducer(buf, group) -> work, the interface of tessel.parallel.data.data_parallel.DataParallel.

    With background=True the algorithm runs on one worker thread per reducer,
    so it overlaps the rest of backward like a native async collective does (a
    p2p algorithm has steps that depend on received data; something must drive
    them, and a backend's own collectives use their own threads the same way).
    One thread, FIFO: buckets are reduced in launch order on every rank, which
    keeps the ranks' message order consistent. With background=False the whole
    algorithm runs inside wait().
    """

    def __init__(self, name: str, nodes: Sequence[Sequence[int]] | None = None, background: bool = True):
        if name not in ("ring", "hierarchical"):
            raise ValueError(f"unknown p2p algorithm {name!r}")
        if name == "hierarchical" and not nodes:
            raise ValueError("hierarchical all-reduce needs the node grouping")
        self.name, self.nodes = name, [list(n) for n in (nodes or [])]
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix=f"tessel-{name}") if background else None

    def _run(self, buf: torch.Tensor, group) -> None:
        if self.name == "ring":
            ring_all_reduce(buf, group)
        else:
            hierarchical_all_reduce(buf, self.nodes, group)

    def __call__(self, buf: torch.Tensor, group) -> Deferred:
        if self.pool is None:
            return Deferred(run=lambda: self._run(buf, group))
        if buf.is_cuda:  # the worker thread's stream must see the finished gradients
            torch.cuda.current_stream(buf.device).synchronize()
        return Deferred(future=self.pool.submit(self._run, buf, group))


def make_reducer(name: str, nodes: Sequence[Sequence[int]] | None = None, background: bool = True):
    """The DP gradient reducer for config parallel.dp_algorithm."""
    if name == "native":
        return native_all_reduce
    return AlgorithmReducer(name, nodes, background)


def dp_reducer(name: str, world_size: int, runtime: RuntimeConfig, background: bool = True):
    """The reducer for config parallel.dp_algorithm; nodes from runtime.topology / nproc_per_node."""
    if name == "native":
        return make_reducer(name)
    nodes = resolve_nodes(world_size, runtime.topology, runtime.nproc_per_node)
    return make_reducer(name, nodes, background)
