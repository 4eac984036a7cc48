"""Where ZeRO keeps parameters between uses: whole on every rank (stages 1, 2), or sharded
and gathered just in time around each unit's forward and backward (stage 3,
Rajbhandari et al. 2020, section 5.3).

A placement lays the parameters out flat (tessel.parallel.zero.flat), says how
they become whole again after the optimizer updated the owned shards (publish),
and, for stage 3, installs the hooks that gather and free them.

Under stage 3 a parameter is whole only while its unit computes, inside
`gathered()` and inside a `state_dict()` call; in between it is an
UngatheredParameter: its shape, dtype, device and gradient can be read, its values
cannot (a Python error names it and says where to read it). `state_dict()` gathers
every parameter and hands back whole copies, as FSDP's full state dict does (on
every rank, in the module's dtype; the fp32 masters are the optimizer's:
ZeroAdamW.checkpoint_tensors), so `save_pretrained` works on a ZeRO-3 model.
`load_state_dict()` writes the loaded values into the fp32 masters too, at every stage.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from functools import partial
from typing import Callable, ContextManager, Iterator, Sequence

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

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

    def root_gathered(self) -> ContextManager[None]:
        """The root unit's parameters whole for the duration, then as they were (stage 3; whole already else)."""
        return contextlib.nullcontext()

    @abstractmethod
    def release(self, g: FlatGroup) -> None:
        """g's gradients have all arrived: backward needs its parameters no more."""

    @abstractmethod
    def end_backward(self) -> None:
        """Backward is over (autograd's final callback)."""

    @abstractmethod
    def publish(self) -> None:
        """After the optimizer updated the owned shards: the parameters the module reads follow."""

    # ---- load_state_dict: the fp32 masters follow what is loaded ---------------------------
    def install_load_hooks(self, module: nn.Module) -> None:
        self._loading: dict[int, torch.Tensor] = {}
        module.register_load_state_dict_pre_hook(self._before_load)
        module.register_load_state_dict_post_hook(self._after_load)

    def _before_load(self, module, state_dict, prefix, *_) -> None:
        """Keep the loaded values of the flat parameters: their masters take them exactly (fp32)."""
        names = param_names(module, prefix)
        self._loading = {id(p): state_dict[n] for g in self.groups for p in g.params
                         for n in reversed(names[id(p)]) if n in state_dict}

    @torch.no_grad()
    def _after_load(self, module, incompatible_keys) -> None:
        for g in self.groups:
            for p, off in zip(g.params, g.offsets):
                value = self._loading.get(id(p))
                a, b = max(g.lo, off), min(g.hi, off + p.numel())
                if value is not None and a < b:
                    g.shard[a - g.lo: b - g.lo].copy_(value.reshape(-1)[a - off: b - off])
        self._loading = {}


class WholeParameters(ParameterPlacement):
    """Stages 1, 2: every rank keeps whole parameters, in gradient buckets; after each step
    every bucket is all-gathered from the updated shards (section 5.1)."""

    def __init__(self, spec: FlatSpec):
        self.groups = bucket_layout(spec)
        self.install_load_hooks(spec.module)

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
        self._holds = 0  # open gathered()/step_gathered()/state_dict() blocks: nothing is freed
        self._state_dicts: list[bool] = []  # per open state_dict() call: whether it gathered
        self._on_backward: Callable[[], None] = lambda: None

    def install_hooks(self, on_backward: Callable[[], None]) -> None:
        self._on_backward = on_backward
        for i, u in enumerate(self.unit_modules):
            u.register_forward_pre_hook(partial(self._pre_forward, i))
            u.register_forward_hook(partial(self._post_forward, i))
        # the root hooks sit on the wrapped module, so calling it directly also works
        self.module.register_forward_pre_hook(self._pre_forward_root)
        self.module.register_forward_hook(self._post_forward_root)
        self.module.register_state_dict_pre_hook(self._before_state_dict)
        # (torch marks a post hook with an attribute, which a bound method cannot take)
        self.module.register_state_dict_post_hook(partial(self._after_state_dict))
        self.install_load_hooks(self.module)
        names = param_names(self.module)
        for g in self.groups:
            for p in g.params:
                name_parameter(p, names[id(p)][0])
        self.reshard_all()

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        with self._held():
            yield

    @contextlib.contextmanager
    def step_gathered(self) -> Iterator[None]:
        with self._held():
            yield

    @contextlib.contextmanager
    def root_gathered(self) -> Iterator[None]:
        """The root unit whole for the duration; freed again after only if it was not whole before. A forward
        without gradients frees it at its end, and the fused loss reads the head after that forward
        (tessel.parallel.fused_loss); within a training step it is whole already and stays so."""
        was_whole = all(g.gathered for g in self.root)
        self._wait_gathered(self.root)
        try:
            yield
        finally:
            if not was_whole:
                self._reshard(self.root)

    @contextlib.contextmanager
    def _held(self) -> Iterator[None]:
        self._hold()
        try:
            yield
        finally:
            self._release_hold()

    def _hold(self) -> None:
        self._wait_gathered(self.groups)
        self._holds += 1

    def _release_hold(self) -> None:
        self._holds -= 1
        self.reshard_all()

    # ---- state dicts: whole copies (FSDP's full state dict) ----------------------------------
    def _before_state_dict(self, module, prefix, keep_vars) -> None:
        # keep_vars hands out the parameters themselves (checkpoints read ZeRO's own tensors):
        # nothing to gather; otherwise the values, whole
        self._state_dicts.append(not keep_vars)
        if not keep_vars:
            self._hold()

    def _after_state_dict(self, module, state_dict, prefix, local_metadata) -> None:
        if not self._state_dicts.pop():
            return
        names = param_names(module, prefix)
        with torch.no_grad():
            for g in self.groups:
                for p in g.params:
                    whole = None  # one copy per parameter: tied names keep sharing it
                    for n in names[id(p)]:
                        if n in state_dict:
                            whole = state_dict[n].clone() if whole is None else whole
                            state_dict[n] = whole
        self._release_hold()

    def _before_load(self, module, state_dict, prefix, *rest) -> None:
        super()._before_load(module, state_dict, prefix, *rest)
        self._hold()  # torch copies the values into the whole parameters

    def _after_load(self, module, incompatible_keys) -> None:
        super()._after_load(module, incompatible_keys)  # and the masters take them
        self._release_hold()

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
            set_whole(g.params, True)

    def _reshard(self, groups: Sequence[FlatGroup]) -> None:
        if self._holds:  # a step's micro-batches (or a gathered() block) still need them
            return
        for g in groups:
            if not g.gathered:
                continue
            if g.gather_work is not None:  # a prefetch nobody used: finish it before freeing
                g.gather_work.wait()
                g.gather_work = None
            set_whole(g.params, False)
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
    """fn on every tensor of a module's inputs or output, each container keeping its type: tuples,
    lists, dicts, named tuples, dataclasses and a transformers ModelOutput (torch's pytree, which
    transformers registers ModelOutput with, as FSDP2 does); other objects as they are."""
    return pytree.tree_map_only(torch.Tensor, fn, output)


def _any_requires_grad(output) -> bool:
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(output))


def param_names(module: nn.Module, prefix: str = "") -> dict[int, list[str]]:
    """id(param) -> every name it has under `module` (tied weights have several)."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(prefix=prefix.removesuffix("."), remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return names


# ---- a stage-3 parameter between uses ------------------------------------------------------
NAME = "tessel_zero3_name"
_T = torch.Tensor
# what reads only a tensor's description, never its values: allowed on a sharded parameter
_DESCRIPTION = {
    _T.shape.__get__, _T.dtype.__get__, _T.device.__get__, _T.layout.__get__, _T.ndim.__get__,
    _T.requires_grad.__get__, _T.requires_grad.__set__, _T.requires_grad_, _T.is_leaf.__get__,
    _T.grad_fn.__get__, _T.grad.__get__, _T.grad.__set__, _T.grad.__delete__, _T._version.__get__,
    _T.is_cuda.__get__, _T.is_cpu.__get__, _T.is_meta.__get__, _T.is_sparse.__get__, _T.is_quantized.__get__,
    _T.nbytes.__get__, _T.itemsize.__get__, _T.size, _T.dim, _T.numel, _T.nelement, _T.element_size,
    _T.stride, _T.storage_offset, _T.is_contiguous, _T.is_floating_point, _T.is_complex, _T.get_device,
    _T.data_ptr, _T.untyped_storage, _T.__hash__, _T.__len__, _T.register_hook,
    _T.register_post_accumulate_grad_hook,
    torch.empty_like, torch.zeros_like, torch.ones_like, torch.full_like, torch.rand_like, torch.randn_like,
}
# what reads the description of its other arguments only: x.view_as(p) is fine, p.view_as(x) is not
_SHAPE_OF_OTHERS = {_T.view_as, _T.reshape_as, _T.expand_as, _T.type_as}


class UngatheredParameter(nn.Parameter):
    """A ZeRO-3 parameter between uses: this rank holds only its shard of the flat group, so the
    parameter's own storage is empty. Its description (shape, dtype, device, grad) reads as usual;
    reading its values raises, naming it, instead of reading freed memory."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _DESCRIPTION or (func in _SHAPE_OF_OTHERS and not isinstance(args[0], cls)):
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        sharded = next((t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, cls)), None)
        name = sharded.__dict__.get(NAME, "?") if sharded is not None else "?"
        raise RuntimeError(
            f"ZeRO-3 parameter '{name}' read outside gathered(): between forwards "
            "this rank holds only its shard. Read it inside `with model.gathered():`, or take "
            "model.state_dict(), which gathers whole copies")


def name_parameter(p: nn.Parameter, name: str) -> None:
    p.__dict__[NAME] = name


def set_whole(params: Sequence[nn.Parameter], whole: bool) -> None:
    """Plain parameters while whole, UngatheredParameter while sharded (a class switch, as
    torch's UninitializedParameter does on materializing: nothing is copied). A parameter of
    another class (a user's subclass) is left as it is."""
    old, new = (UngatheredParameter, nn.Parameter) if whole else (nn.Parameter, UngatheredParameter)
    for p in params:
        if type(p) is old:
            p.__class__ = new
