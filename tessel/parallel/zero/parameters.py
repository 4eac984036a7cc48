"""Where ZeRO keeps parameters between uses: whole on every rank (stages 1, 2), or sharded
and gathered just in time around each unit's forward and backward (stage 3,
Rajbhandari et al. 2020, section 5.3).

A placement lays the parameters out flat (tessel.parallel.zero.flat), says how
they become whole again after the optimizer updated the owned shards (publish),
and, for stage 3, installs the hooks that gather and free them.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from functools import partial
from typing import Callable, ContextManager, Iterator, Sequence

import torch

from tessel.parallel.zero.collectives import all_gather_shards
from tessel.parallel.zero.flat import FlatGroup, FlatSpec, bucket_layout, unit_layout


class ParameterPlacement(ABC):
    """Where the parameters of the flat groups live between uses; see the module docstring."""

    groups: list[FlatGroup]  # gradient order: the order their reductions are launched in

    @abstractmethod
    def install_hooks(self, on_backward: Callable[[], None]) -> None:
        """Hook into the module's forward; `on_backward` is called when a backward reaches it."""

    @abstractmethod
    def gathered(self) -> ContextManager[None]:
        """Every parameter whole for the duration (state dicts, checks, evaluation)."""

    @abstractmethod
    def step_gathered(self) -> ContextManager[None]:
        """Every parameter whole for a whole step, forwards and backwards of all its
        micro-batches (a pipeline's schedule interleaves them); sharded again at the end."""

    @abstractmethod
    def release(self, g: FlatGroup) -> None:
        """g's gradients have all arrived: backward needs its parameters no more."""

    @abstractmethod
    def end_backward(self) -> None:
        """Backward is over (autograd's final callback)."""

    @abstractmethod
    def publish(self) -> None:
        """After the optimizer updated the owned shards: the parameters the module reads follow."""


class WholeParameters(ParameterPlacement):
    """Stages 1, 2: every rank keeps whole parameters, in gradient buckets; after each step
    every bucket is all-gathered from the updated shards (section 5.1)."""

    def __init__(self, spec: FlatSpec):
        self.groups = bucket_layout(spec)

    def install_hooks(self, on_backward: Callable[[], None]) -> None:
        pass  # parameters are always whole: nothing to do around forward or backward

    def gathered(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def step_gathered(self) -> ContextManager[None]:
        return contextlib.nullcontext()

    def release(self, g: FlatGroup) -> None:
        pass

    def end_backward(self) -> None:
        pass

    @torch.no_grad()
    def publish(self) -> None:
        works = [all_gather_shards(g.full, g.shard_source(), g.comm.group) for g in self.groups]
        for w in works:
            if w is not None:
                w.wait()


class _PreBackwardGather(torch.autograd.Function):
    """Identity on a unit's output; its backward gathers the unit's parameters.

    Autograd reaches a unit's own nodes only through the gradient of its
    output, so this is the last moment before the unit's backward: the gather
    hook of ZeRO-3 (Rajbhandari et al. 2020, section 5.3), which also
    prefetches the unit before it."""

    @staticmethod
    def forward(ctx, placement: "GatheredParameters", unit: int, x: torch.Tensor) -> torch.Tensor:
        ctx.placement, ctx.unit = placement, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.placement.before_backward(ctx.unit)
        return None, None, grad


class GatheredParameters(ParameterPlacement):
    """Stage 3 (P_p, section 5.3): a rank keeps only its shard of each unit's parameters.

    Each unit is all-gathered just before its forward and again just before its
    backward, and freed after each; the next unit's gather is issued before the
    current one computes (prefetch), so communication overlaps compute. The root
    unit (what no unit holds: embedding, head) stays gathered from the start of
    forward to the end of backward."""

    def __init__(self, spec: FlatSpec):
        layout = unit_layout(spec)
        self.module, self.unit_modules = spec.module, layout.modules
        self.units, self.root = layout.units, layout.root  # forward order; the root
        self.groups = layout.gradient_order()
        self._hold = False  # inside step_gathered: nothing is freed
        self._on_backward: Callable[[], None] = lambda: None

    def install_hooks(self, on_backward: Callable[[], None]) -> None:
        self._on_backward = on_backward
        for i, u in enumerate(self.unit_modules):
            u.register_forward_pre_hook(partial(self._pre_forward, i))
            u.register_forward_hook(partial(self._post_forward, i))
        # the root hooks sit on the wrapped module, so calling it directly also works
        self.module.register_forward_pre_hook(self._pre_forward_root)
        self.module.register_forward_hook(self._post_forward_root)
        self.reshard_all()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        self._wait_gathered(self.groups)
        try:
            yield
        finally:
            self.reshard_all()

    @contextlib.contextmanager
    def step_gathered(self) -> Iterator[None]:
        self._wait_gathered(self.groups)
        self._hold = True
        try:
            yield
        finally:
            self._hold = False
            self.reshard_all()

    def release(self, g: FlatGroup) -> None:
        if g.index >= 0:  # a unit's backward is over: no node needs its weights
            self._reshard([g])

    def end_backward(self) -> None:
        self.reshard_all()

    def publish(self) -> None:
        pass  # the next forward gathers from the updated shards

    # ---- gather and free ---------------------------------------------------------------
    def _gather_async(self, groups: Sequence[FlatGroup]) -> None:
        for g in groups:
            if g.gathered:
                continue
            g.full.untyped_storage().resize_(g.full.numel() * g.full.element_size())
            with torch.no_grad():
                g.gather_work = all_gather_shards(g.full, g.shard_source(), g.comm.group)
            g.gathered = True

    def _wait_gathered(self, groups: Sequence[FlatGroup]) -> None:
        self._gather_async(groups)
        for g in groups:
            if g.gather_work is not None:
                g.gather_work.wait()
                g.gather_work = None

    def _reshard(self, groups: Sequence[FlatGroup]) -> None:
        if self._hold:  # a step's micro-batches still need them; step_gathered frees at its end
            return
        for g in groups:
            if not g.gathered:
                continue
            if g.gather_work is not None:  # a prefetch nobody used: finish it before freeing
                g.gather_work.wait()
                g.gather_work = None
            g.full.untyped_storage().resize_(0)
            g.gathered = False

    def reshard_all(self) -> None:
        self._reshard(self.groups)

    def _prefetch(self, unit: int) -> None:
        if 0 <= unit < len(self.units):
            self._gather_async(self.units[unit])

    # ---- the hooks -----------------------------------------------------------------------
    def _pre_forward_root(self, module, args) -> None:
        # issue the first unit's gather with the root's, before waiting on either
        self._gather_async(self.root)
        self._prefetch(0)
        self._wait_gathered(self.root)

    def _post_forward_root(self, module, args, output):
        if _in_backward():
            return output
        if not (torch.is_grad_enabled() and _any_requires_grad(output)):
            self.reshard_all()  # no backward will follow (evaluation, sampling)
            return output
        # the root stays gathered until backward ends; it is gathered again before its
        # backward in case another backward freed it meanwhile (pipeline micro-batches)
        return map_tensors(output, lambda t: _PreBackwardGather.apply(self, -1, t) if t.requires_grad else t)

    def _pre_forward(self, unit: int, module, args) -> None:
        self._gather_async(self.units[unit])
        if not _in_backward():
            self._prefetch(unit + 1)  # issued before the wait below, so it is in flight during it
        self._wait_gathered(self.units[unit])

    def _post_forward(self, unit: int, module, args, output):
        if _in_backward():
            # recomputation (activation checkpointing) inside the unit's backward: the
            # graph it just built needs the weights at once, so keep them; they are
            # freed when the unit's gradients are ready
            return output
        if torch.is_grad_enabled():
            output = map_tensors(output, lambda t: _PreBackwardGather.apply(self, unit, t)
                                 if t.requires_grad else t)
        self._reshard(self.units[unit])
        return output

    def before_backward(self, unit: int) -> None:
        """`unit` is about to run backward (-1: the root, first of all); gather it, prefetch the next."""
        self._on_backward()  # the engine's end-of-backward callback reshards, even under no_sync
        groups = self.root if unit < 0 else self.units[unit]
        self._gather_async(groups)
        self._prefetch(len(self.units) - 1 if unit < 0 else unit - 1)  # in flight during the wait
        self._wait_gathered(groups)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def map_tensors(output, fn):
    """fn on every tensor of a module's output (nested tuples, lists, dicts); the rest as is."""
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, (tuple, list)):
        return type(output)(map_tensors(o, fn) for o in output)
    if isinstance(output, dict):
        return {k: map_tensors(v, fn) for k, v in output.items()}
    return output


def _any_requires_grad(output) -> bool:
    found = []
    map_tensors(output, lambda t: found.append(t.requires_grad))
    return any(found)
