"""What backward does with gradients under ZeRO: all-reduce them whole (stage 1) or
reduce-scatter them to their owners (stages 2, 3; Rajbhandari et al. 2020, section 5.2).

GradientReduction holds what every stage shares: a flat group is reduced once
all its parameters' gradients have arrived, groups are launched in one order on
every rank (collectives must match), and every gradient ends up divided by the
number of data shards, also one summed over fewer ranks (experts: the
all-to-all's backward already summed the other ep ranks' tokens into it), as in
tessel.parallel.data.data_parallel. Its two subclasses are the stages' own code.

A parameter without a gradient takes part as "no gradient" (-0.0 in every element,
tessel.parallel.data.unused), and the buffers that accumulate gradients start from
it, so the owner of a piece of a parameter no rank used finds -0.0 there and the
optimizer leaves that piece alone (tessel.parallel.zero.optim).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.parallel.data.data_parallel import is_view
from tessel.parallel.data.unused import NO_GRADIENT, mark_no_gradient
from tessel.parallel.zero.collectives import all_reduce_gradients, reduce_scatter_gradients
from tessel.parallel.zero.flat import FlatGroup

# reductions in flight at once (stages 2, 3): each holds a full-size gradient
# buffer. One overlaps the next unit's backward (as FSDP does) and keeps the
# gradient memory of backward at about two units; two measured 4% more peak
# memory in benchmarks/zero_vs_fsdp.py on CPU.
MAX_IN_FLIGHT = 1


class GradientReduction(ABC):
    """Gradients of flat groups to their owners, in the same order on every rank.

    `add_into_buffer`: gradients are reduced in another dtype than the parameters'
    (mixed precision), so a gradient cannot be its parameter's .grad and is added
    into the flat buffer instead, in the reduction's dtype."""

    max_in_flight: int | None = None  # beyond this many reductions in flight, wait for the oldest; None: no limit

    def __init__(self, groups: list[FlatGroup], data_shards: int, add_into_buffer: bool):
        self.groups, self.data_shards, self.add_into_buffer = groups, data_shards, add_into_buffer
        self._where = {id(p): (gi, i) for gi, g in enumerate(groups) for i, p in enumerate(g.params)}
        self._next_to_launch = 0
        self._in_flight: deque[FlatGroup] = deque()
        for g in groups:
            self.allocate(g)

    # ---- what a stage decides -----------------------------------------------------
    @abstractmethod
    def allocate(self, g: FlatGroup) -> None:
        """Set up g's gradient buffers: the flat one (Bucket.buffer) and the owned shard."""

    @abstractmethod
    def store(self, g: FlatGroup, i: int, p: nn.Parameter, sync: bool) -> None:
        """p (parameter i of g) has a fresh gradient in p.grad: keep it until g is reduced.
        `sync`: this backward reduces (False in a no_sync micro-step, which only accumulates)."""

    @abstractmethod
    def start(self, g: FlatGroup) -> dist.Work | None:
        """Launch g's reduction; returns its work object."""

    @abstractmethod
    def deliver(self, g: FlatGroup) -> None:
        """g's reduction is done: its mean gradient into the owned shard (g.grad_shard)."""

    @abstractmethod
    def fill_missing(self, g: FlatGroup, i: int, p: nn.Parameter) -> None:
        """Parameter i of g got no gradient in this backward: it takes part as "no gradient"."""

    @abstractmethod
    def zero(self, g: FlatGroup) -> None:
        """The optimizer stepped: the next step's gradients start from "no gradient"."""

    # ---- what every stage shares ---------------------------------------------------
    def arrived(self, p: nn.Parameter, sync: bool) -> FlatGroup | None:
        """p's gradient is accumulated (autograd's hook); returns its group once complete."""
        gi, i = self._where[id(p)]
        g = self.groups[gi]
        self.store(g, i, p, sync)
        g.ready.add(i)
        return g if g.complete() else None

    def launch_ready(self) -> None:
        # every rank must issue its collectives in the same order: launch by group index
        while self._next_to_launch < len(self.groups) and self.groups[self._next_to_launch].complete():
            self._launch(self.groups[self._next_to_launch])
            self._next_to_launch += 1

    def _launch(self, g: FlatGroup) -> None:
        g.work = self.start(g)
        self._in_flight.append(g)
        while self.max_in_flight is not None and len(self._in_flight) > self.max_in_flight:
            self._complete(self._in_flight.popleft())

    def _complete(self, g: FlatGroup) -> None:
        if g.work is not None:
            g.work.wait()
            g.work = None
        self.deliver(g)

    def reduce_all(self) -> None:
        """End of a synchronised backward: every group reduced and delivered. Parameters that
        got no gradient still take part (as -0.0), so every rank reduces the same groups."""
        for g in self.groups:
            for i, p in enumerate(g.params):
                if i not in g.ready:
                    self.fill_missing(g, i, p)
                    g.ready.add(i)
        self.launch_ready()
        while self._in_flight:
            self._complete(self._in_flight.popleft())

    def end_backward(self) -> None:
        """The next backward starts counting arrivals afresh."""
        for g in self.groups:
            g.ready.clear()
        self._next_to_launch = 0

    def zero_all(self) -> None:
        for g in self.groups:
            self.zero(g)


class AllReduceGradients(GradientReduction):
    """Stage 1 (P_os, section 5.1): whole gradients, all-reduced in buckets as plain data
    parallelism does; the optimizer reads only the owned shard of the result.

    Gradients live in each group's flat buffer from the first backward on (p.grad is
    a view of it), so the all-reduce needs no copy. The owned shard of the buffer is
    the optimizer's gradient: a view when the reduction is fp32, else a copy."""

    max_in_flight = None  # the buffers persist anyway: every bucket may be in flight

    def allocate(self, g: FlatGroup) -> None:
        g.buffer = torch.full(g.full.shape, NO_GRADIENT, dtype=g.grad_dtype, device=g.full.device)
        g.grad_shard = (g.buffer[g.lo: g.hi] if g.grad_dtype == g.shard.dtype
                        else torch.full_like(g.shard, NO_GRADIENT))

    def store(self, g: FlatGroup, i: int, p: nn.Parameter, sync: bool) -> None:
        view = g.view_of(i)
        if self.add_into_buffer:
            # accumulate in grad_dtype over micro-steps, not in the parameter's dtype
            view.add_(p.grad)
            p.grad = None
        elif not is_view(p.grad, view):
            # autograd made a fresh gradient: keep it in the flat buffer from now on
            view.copy_(p.grad)
            p.grad = view

    def start(self, g: FlatGroup) -> dist.Work | None:
        return all_reduce_gradients(g.buffer, g.comm.group)

    def deliver(self, g: FlatGroup) -> None:
        g.buffer.div_(self.data_shards)
        if g.grad_dtype != g.shard.dtype:  # the fp32 shard is a copy, not a view
            g.grad_shard.copy_(g.buffer[g.lo: g.hi])

    def fill_missing(self, g: FlatGroup, i: int, p: nn.Parameter) -> None:
        if self.add_into_buffer:
            return  # the view holds "no gradient" or what earlier micro-steps added
        view = g.view_of(i)
        if p.grad is None:
            mark_no_gradient(view)
        elif not is_view(p.grad, view):
            view.copy_(p.grad)
        p.grad = view

    def zero(self, g: FlatGroup) -> None:
        mark_no_gradient(g.buffer)  # the owned gradient shard is a view of it (fp32)
        mark_no_gradient(g.grad_shard)  # or a copy (another grad_dtype)


class ReduceScatterGradients(GradientReduction):
    """Stages 2, 3 (P_g, section 5.2): each group's gradient is reduce-scattered as soon as
    backward has filled it, and freed, so a rank keeps only the gradient shard it owns.

    Autograd's own gradients stay in p.grad until the whole group is ready and are
    flattened only then, so no flat buffer is held through a unit's backward; at most
    MAX_IN_FLIGHT reductions (each holding its full-size input) are in flight."""

    max_in_flight = MAX_IN_FLIGHT

    def allocate(self, g: FlatGroup) -> None:
        g.buffer = None  # allocated by the group's reduction, freed once reduce-scattered
        g.grad_shard = torch.full_like(g.shard, NO_GRADIENT)

    def store(self, g: FlatGroup, i: int, p: nn.Parameter, sync: bool) -> None:
        if self.add_into_buffer and not sync:
            # a no_sync micro-step under mixed precision: accumulate in grad_dtype
            g.grad_view(i).add_(p.grad)
            p.grad = None

    def start(self, g: FlatGroup) -> dist.Work | None:
        self._flatten_grads(g)
        g.out = torch.empty(g.grad_shard.shape, dtype=g.grad_dtype, device=g.grad_shard.device)
        work = reduce_scatter_gradients(g.out, g.buffer, g.comm.group)
        # the full gradient is dropped at once: the collective's work object holds its
        # input until it is done (gloo even reduces a copy of it), so it is freed as
        # early as the backend allows
        g.buffer = None
        for p in g.params:
            p.grad = None
        return work

    def deliver(self, g: FlatGroup) -> None:
        # add: gradients accumulate across steps; the mean in the same pass (-0.0 stays -0.0
        # only where every micro-step brought "no gradient")
        g.grad_shard.add_(g.out, alpha=1.0 / self.data_shards)
        g.out = None

    def fill_missing(self, g: FlatGroup, i: int, p: nn.Parameter) -> None:
        pass  # _flatten_grads writes "no gradient" for a parameter without one

    def zero(self, g: FlatGroup) -> None:
        mark_no_gradient(g.grad_shard)
        g.buffer = None  # gradients left over from no_sync micro-steps
        for p in g.params:
            p.grad = None

    @staticmethod
    def _flatten_grads(g: FlatGroup) -> None:
        """The group's gradients into one flat buffer, the reduce-scatter's input (cast to
        grad_dtype), added to what no_sync micro-steps left there under mixed precision."""
        if g.buffer is not None:
            for i, p in enumerate(g.params):
                if p.grad is not None:
                    g.view_of(i).add_(p.grad)
                p.grad = None
            return
        # every element is written: a gradient, "no gradient" for a parameter without one, zero padding
        g.buffer = torch.empty(g.full.shape, dtype=g.grad_dtype, device=g.full.device)
        g.buffer[max(o + p.numel() for o, p in zip(g.offsets, g.params)):].zero_()
        for i, p in enumerate(g.params):
            mark_no_gradient(g.view_of(i)) if p.grad is None else g.view_of(i).copy_(p.grad)
            p.grad = None
