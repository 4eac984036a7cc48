"""ZeRO: optimizer-state, gradient and parameter sharding over the data-parallel axes.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models". Parameters live in flat buffers ("flat groups"), each
zero-padded to a multiple of N, the size of the data-parallel group, and cut
into N equal contiguous shards; rank r owns shard r of every group.

- stage 1: every rank keeps full parameters and full gradients, all-reduced in
  buckets during backward as in tessel.parallel.data.data_parallel; the optimizer state
  covers the owned shard only. Each rank updates its shard of the flat fp32
  buffer, then every buffer is all-gathered.
- stage 2: as stage 1, but each gradient bucket is reduce-scattered as soon as
  backward has filled it (post-accumulate-grad hooks) and then freed, so a rank
  keeps only the gradient shard it owns.
- stage 3: parameters are sharded too. Each unit (by default every child of
  every nn.ModuleList, plus the rest of the model as the root unit) is
  all-gathered just before its forward and again just before its backward,
  and freed after each; the next unit's gather is issued before the current
  unit computes (prefetch), so communication overlaps compute. The root unit
  stays gathered from the start of forward to the end of backward.

Precision. By default parameters, gradients and optimizer state are fp32, so
the parameters are the master weights; bf16 compute comes from autocast
(train.precision = "bf16"), which casts each weight to bf16 at its matmul.
Memory per rank for Psi parameters, N ranks, AdamW (exp_avg and exp_avg_sq):

    stage  params   grads    optimizer
    0      4Psi     4Psi     8Psi
    1      4Psi     4Psi     8Psi/N
    2      4Psi     4Psi/N   8Psi/N
    3      4Psi/N   4Psi/N   8Psi/N       (plus the units gathered at the moment)

Mixed-precision storage (param_dtype, reduce_dtype; FSDP2's MixedPrecisionPolicy,
and the paper's fp16 parameters and gradients with fp32 master copies): the
module's parameters, and every all-gather of them, are in param_dtype (p bytes),
its floating inputs are cast to it, and gradients are accumulated and reduced in
reduce_dtype (r bytes). The owned shard of the fp32 master weights, its fp32
gradient and AdamW's state stay fp32, and the optimizer updates those; the
low-precision parameters are refreshed from them (stages 1, 2: cast and
all-gathered after each step; stage 3: at every gather). Per rank:

    stage  params             grads              optimizer
    1      pPsi + 4Psi/N      rPsi + 4Psi/N (*)  8Psi/N
    2      pPsi + 4Psi/N      4Psi/N             8Psi/N
    3      4Psi/N             4Psi/N             8Psi/N   (gathered units take p bytes per element)
    (*) rPsi alone when r = 4: the fp32 shard is then a view of the reduced buffer

The optimizer (tessel.parallel.zero.optim) is torch's AdamW stepping
"segments": the pieces of the owned shard that belong to parameters of one
weight-decay class and one sharding class. They are marked sharded over the ZeRO axes (tessel.parallel.norms), so
the global gradient norm over the optimizer's parameters is the norm of the
whole model. Usage, on any nn.Module:

    model, opt = zero_parallel(model, mesh, stage=3, lr=3e-4, weight_decay=0.1)
    # model(...) trains as usual; under stage 3, read weights inside `with model.gathered():`
    with model.no_sync():                 # accumulation micro-steps: no traffic
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()     # gradients reach their owners, averaged
    clip_grad_norm_(opt.grad_params(), 1.0, mesh)
    opt.step()                            # update own shard, all-gather (stages 1, 2)
    opt.zero_grad()
"""

from __future__ import annotations

import contextlib
from collections import deque
from functools import partial
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.data.data_parallel import GradientSyncWrapper, broadcast_tensors, data_parallel
from tessel.parallel.zero.flat import Comm, FlatGroup, all_gather, bucket_groups, find_units, reduce_scatter, unit_group
from tessel.parallel.zero.optim import ZeroAdamW, decay_groups, default_decay
from tessel.sharding import shard_axes

# reductions in flight at once (stages 2, 3): each holds a full-size gradient
# buffer. One overlaps the next unit's backward (as FSDP does) and keeps the
# gradient memory of backward at about two units; two measured 4% more peak
# memory in benchmarks/zero_vs_fsdp.py on CPU.
MAX_IN_FLIGHT = 1


class _PreBackwardGather(torch.autograd.Function):
    """Identity on a unit's output; its backward gathers the unit's parameters.

    Autograd reaches a unit's own nodes only through the gradient of its
    output, so this is the last moment before the unit's backward: the gather
    hook of ZeRO-3 (Rajbhandari et al. 2020, section 5.3), which also
    prefetches the unit before it."""

    @staticmethod
    def forward(ctx, engine: "ZeroDataParallel", unit: int, x: torch.Tensor) -> torch.Tensor:
        ctx.engine, ctx.unit = engine, unit
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ctx.engine._before_backward(ctx.unit)
        return None, None, grad


class ZeroDataParallel(GradientSyncWrapper):
    """Wraps a module; ZeRO stage 1, 2 or 3 over `axes` of the mesh. See the module docstring."""

    def __init__(self, module: nn.Module, mesh: Mesh, stage: int, axes: Sequence[str] = ("dp",),
                 bucket_mb: float = 25.0, units: Sequence[nn.Module] | None = None, broadcast: bool = True,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None):
        super().__init__()
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 (0 is tessel.parallel.data.data_parallel), got {stage}")
        self.module, self.stage, self.axes = module, stage, tuple(axes)
        # mixed precision (see the module docstring): the module computes with parameters
        # in param_dtype, gradients are reduced in reduce_dtype (default: param_dtype)
        self.param_dtype = param_dtype or torch.float32
        self.grad_dtype = reduce_dtype or self.param_dtype
        # a gradient of another dtype than its parameter cannot be its .grad: such
        # gradients are added into the flat buffer and dropped by the hook
        self._add_into_buffer = self.grad_dtype != self.param_dtype
        # every gradient is divided by the number of data shards, also one summed over
        # fewer ranks (experts: the all-to-all's backward already summed the other ep
        # ranks' tokens into it), as in tessel.parallel.data.data_parallel
        self.data_shards = mesh.size(*self.axes)
        self.sync_gradients = True
        params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
        bad = [p.dtype for p in params if p.dtype != torch.float32]
        if bad:
            raise ValueError(f"ZeRO keeps fp32 master weights: parameters must be fp32 (found {bad[0]}); "
                             "use autocast for bf16 compute")
        # a parameter already sharded over an axis (experts over ep) is sharded and
        # reduced over the remaining ZeRO axes only
        by_comm: dict[Comm, list[nn.Parameter]] = {}
        for p in params:
            key = tuple(a for a in self.axes if a not in shard_axes(p))
            by_comm.setdefault(self._comm(mesh, key), []).append(p)
        if broadcast:
            self._broadcast(mesh, module, by_comm)
        if stage == 3:
            self.groups = self._unit_groups(by_comm, find_units(module) if units is None else list(units))
        else:
            order = {id(p): i for i, p in enumerate(reversed(params))}
            self.groups = sorted((g for comm, ps in by_comm.items()
                                  for g in bucket_groups(ps, int(bucket_mb * 2**20), comm, stage, order,
                                                         self.param_dtype, self.grad_dtype)),
                                 key=lambda g: g.first)
        self._where = {id(p): (gi, i) for gi, g in enumerate(self.groups) for i, p in enumerate(g.params)}
        self._next_to_launch = 0
        self._callback_queued = False
        self._in_flight: deque[FlatGroup] = deque()
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        if stage == 3:
            self._install_unit_hooks()
            self.reshard_all()
        if self.param_dtype != torch.float32:
            module.register_forward_pre_hook(self._cast_inputs)

    # ---- layout ------------------------------------------------------------------
    @staticmethod
    def _comm(mesh: Mesh, axes: tuple[str, ...]) -> Comm:
        group = mesh.group(*axes)
        # the shard order of a collective is the rank order inside its process group
        return Comm(axes, group, mesh.size(*axes), dist.get_rank(group) if group is not None else 0)

    def _broadcast(self, mesh: Mesh, module: nn.Module, by_comm: dict[Comm, list[nn.Parameter]]) -> None:
        """Every rank of a group starts from the same weights: those of its first rank."""
        for comm, ps in by_comm.items():
            if comm.group is not None:
                broadcast_tensors(ps, src=mesh.group_ranks(comm.axes)[0], group=comm.group)
        buffers = list(module.buffers())
        group = mesh.group(*self.axes)
        if buffers and group is not None:
            broadcast_tensors(buffers, src=mesh.group_ranks(self.axes)[0], group=group)

    def _unit_groups(self, by_comm: dict[Comm, list[nn.Parameter]], units: list[nn.Module]) -> list[FlatGroup]:
        """Stage 3: one flat group per unit and process group, in gradient order."""
        comm_of = {id(p): comm for comm, ps in by_comm.items() for p in ps}
        claimed: set[int] = set()
        self.units: list[list[FlatGroup]] = []  # forward order
        self._unit_modules: list[nn.Module] = []
        for u in units:
            ps = [p for p in dict.fromkeys(u.parameters()) if id(p) in comm_of and id(p) not in claimed]
            claimed.update(id(p) for p in ps)
            if ps:
                self.units.append(self._split_by_comm(ps, comm_of, len(self.units)))
                self._unit_modules.append(u)
        rest = [p for ps in by_comm.values() for p in ps if id(p) not in claimed]
        self.root = self._split_by_comm(rest, comm_of, -1)
        # gradients of the last unit are ready first; the root (embedding, head) completes last
        return [g for unit in reversed(self.units) for g in unit] + self.root

    def _split_by_comm(self, ps, comm_of, index) -> list[FlatGroup]:
        per: dict[Comm, list[nn.Parameter]] = {}
        for p in ps:
            per.setdefault(comm_of[id(p)], []).append(p)
        return [unit_group(group_ps, comm, index, self.param_dtype, self.grad_dtype)
                for comm, group_ps in per.items()]

    def _cast_inputs(self, module, args):
        """Floating-point inputs to param_dtype, as the parameters they meet (FSDP2 does the same)."""
        return _map_tensors(args, lambda t: t.to(self.param_dtype) if t.is_floating_point() else t)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Stage 3: every parameter whole for the duration (state dicts, checks). No-op otherwise."""
        if self.stage == 3:
            self._wait_gathered(self.groups)
        try:
            yield
        finally:
            if self.stage == 3:
                self.reshard_all()

    # ---- stage 3: gather just in time, free after --------------------------------------
    def _install_unit_hooks(self) -> None:
        for i, u in enumerate(self._unit_modules):
            u.register_forward_pre_hook(partial(self._pre_forward, i))
            u.register_forward_hook(partial(self._post_forward, i))
        # the root hooks sit on the wrapped module, so calling it directly also works
        self.module.register_forward_pre_hook(self._pre_forward_root)
        self.module.register_forward_hook(self._post_forward_root)

    def _gather_async(self, groups: Sequence[FlatGroup]) -> None:
        for g in groups:
            if g.gathered:
                continue
            g.full.untyped_storage().resize_(g.full.numel() * g.full.element_size())
            with torch.no_grad():
                g.gather_work = all_gather(g.full, g.shard_source(), g.comm.group)
            g.gathered = True

    def _wait_gathered(self, groups: Sequence[FlatGroup]) -> None:
        self._gather_async(groups)
        for g in groups:
            if g.gather_work is not None:
                g.gather_work.wait()
                g.gather_work = None

    def _reshard(self, groups: Sequence[FlatGroup]) -> None:
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
        return _map_tensors(output, lambda t: _PreBackwardGather.apply(self, -1, t) if t.requires_grad else t)

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
            output = _map_tensors(output, lambda t: _PreBackwardGather.apply(self, unit, t)
                                  if t.requires_grad else t)
        self._reshard(self.units[unit])
        return output

    def _before_backward(self, unit: int) -> None:
        """`unit` is about to run backward (-1: the root, first of all); gather it, prefetch the next."""
        self._queue_finish()  # reshard at the end even under no_sync
        groups = self.root if unit < 0 else self.units[unit]
        self._gather_async(groups)
        self._prefetch(len(self.units) - 1 if unit < 0 else unit - 1)  # in flight during the wait
        self._wait_gathered(groups)

    # ---- backward: gradients to their owners ---------------------------------------
    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _grad_view(self, g: FlatGroup, i: int) -> torch.Tensor:
        """Parameter i's view of the flat gradient buffer (mixed precision: zeros when new)."""
        if g.buffer is None:  # stage 1 keeps its buffer: only the mixed path gets here
            g.buffer = torch.zeros(g.full.shape, dtype=g.grad_dtype, device=g.full.device)
        return g.view_of(i)

    def _on_grad_ready(self, p: nn.Parameter) -> None:
        gi, i = self._where[id(p)]
        g = self.groups[gi]
        if self._add_into_buffer and (self.stage == 1 or not self.sync_gradients):
            # accumulate in grad_dtype over micro-steps, not in the parameter's dtype
            self._grad_view(g, i).add_(p.grad)
            p.grad = None
        elif self.stage == 1 and p.grad.data_ptr() != g.view_of(i).data_ptr():
            # autograd made a fresh gradient: keep it in the flat buffer from now on
            g.view_of(i).copy_(p.grad)
            p.grad = g.view_of(i)
        # stages 2, 3: autograd's own gradient stays in p.grad until the whole group is
        # ready (_flatten_grads), so no flat buffer is held through the unit's backward
        self._queue_finish()
        g.ready.add(i)
        if len(g.ready) < len(g.params):
            return
        if self.stage == 3 and g.index >= 0:
            self._reshard([g])  # the unit's backward is over: no node needs its weights
        if self.sync_gradients:
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        # every rank must issue its collectives in the same order: launch by group index
        while self._next_to_launch < len(self.groups):
            g = self.groups[self._next_to_launch]
            if len(g.ready) < len(g.params):
                return
            self._launch(g)
            self._next_to_launch += 1

    def _launch(self, g: FlatGroup) -> None:
        if self.stage == 1:
            g.work = dist.all_reduce(g.buffer, group=g.comm.group, async_op=True) if g.comm.group else None
        else:
            self._flatten_grads(g)
            g.out = torch.empty(g.grad_shard.shape, dtype=g.grad_dtype, device=g.grad_shard.device)
            g.work = reduce_scatter(g.out, g.buffer, g.comm.group)
            # the full gradient is dropped at once: the collective's work object holds
            # its input until it is done (gloo even reduces a copy of it), so it is freed
            # as early as the backend allows
            g.buffer = None
            for p in g.params:
                p.grad = None
        self._in_flight.append(g)
        while self.stage > 1 and len(self._in_flight) > MAX_IN_FLIGHT:
            self._complete(self._in_flight.popleft())

    def _flatten_grads(self, g: FlatGroup) -> None:
        """Stages 2, 3: the group's gradients into one flat buffer, the reduce-scatter's input
        (cast to grad_dtype), added to what no_sync micro-steps left there under mixed precision."""
        if g.buffer is not None:
            for i, p in enumerate(g.params):
                if p.grad is not None:
                    g.view_of(i).add_(p.grad)
                p.grad = None
            return
        # every element is written: a gradient, zeros for a parameter without one, zero padding
        g.buffer = torch.empty(g.full.shape, dtype=g.grad_dtype, device=g.full.device)
        g.buffer[max(o + p.numel() for o, p in zip(g.offsets, g.params)):].zero_()
        for i, p in enumerate(g.params):
            g.view_of(i).zero_() if p.grad is None else g.view_of(i).copy_(p.grad)
            p.grad = None

    def _complete(self, g: FlatGroup) -> None:
        if g.work is not None:
            g.work.wait()
            g.work = None
        if self.stage == 1:
            g.buffer.div_(self.data_shards)
            if g.grad_dtype != g.shard.dtype:  # the fp32 shard is a copy, not a view
                g.grad_shard.copy_(g.buffer[g.lo: g.hi])
        else:
            # add: gradients accumulate across steps; the mean in the same pass
            g.grad_shard.add_(g.out, alpha=1.0 / self.data_shards)
            g.out = None

    def _finish(self) -> None:
        if self.sync_gradients:
            # parameters that got no gradient still take part (as zeros), so every
            # rank reduces the same groups
            for g in self.groups:
                for i, p in enumerate(g.params):
                    if i not in g.ready:
                        view = self._grad_view(g, i) if self.stage == 1 else None
                        # _add_into_buffer: the view holds zeros or what earlier micro-steps
                        # added; stages 2, 3: _flatten_grads writes zeros for it
                        if view is not None and not self._add_into_buffer and (
                                p.grad is None or p.grad.data_ptr() != view.data_ptr()):
                            view.zero_() if p.grad is None else view.copy_(p.grad)
                            p.grad = view
                        g.ready.add(i)
            self._launch_ready_in_order()
            while self._in_flight:
                self._complete(self._in_flight.popleft())
        for g in self.groups:
            g.ready.clear()
        if self.stage == 3:
            self.reshard_all()
        self._next_to_launch = 0
        self._callback_queued = False

    # ---- optimizer side ---------------------------------------------------------------
    @torch.no_grad()
    def publish(self) -> None:
        """After the optimizer updated the owned shards: make the parameters whole (stages 1, 2)."""
        if self.stage == 3:
            return  # the next forward gathers from the updated shards
        works = [all_gather(g.full, g.shard_source(), g.comm.group) for g in self.groups]
        for w in works:
            if w is not None:
                w.wait()

    def zero_grad_buffers(self) -> None:
        for g in self.groups:
            if self.stage == 1:
                g.buffer.zero_()  # the owned gradient shard is a view of it (fp32)
                g.grad_shard.zero_()  # or a copy (another grad_dtype)
                continue
            g.grad_shard.zero_()
            g.buffer = None  # gradients left over from no_sync micro-steps
            for p in g.params:
                p.grad = None

    def reduce_gradients(self) -> None:
        """Reduce now, outside backward, what backward accumulated with sync_gradients = False.

        A pipeline whose first and last stages share the tied embedding sums the two
        full gradients between stages first (that needs every stage's backward done),
        then calls this, so the owners receive the tied sum (tessel.parallel.pipeline)."""
        self.sync_gradients = True
        self._finish()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _map_tensors(output, fn):
    if isinstance(output, torch.Tensor):
        return fn(output)
    if isinstance(output, (tuple, list)):
        return type(output)(_map_tensors(o, fn) for o in output)
    if isinstance(output, dict):
        return {k: _map_tensors(v, fn) for k, v in output.items()}
    return output


def _any_requires_grad(output) -> bool:
    found = []
    _map_tensors(output, lambda t: found.append(t.requires_grad))
    return any(found)


def zero_parallel(module: nn.Module, mesh: Mesh, stage: int, *, lr: float = 1e-3, betas=(0.9, 0.999),
                  eps: float = 1e-8, weight_decay: float = 0.01,
                  decay: Callable[[nn.Parameter], bool] = default_decay, axes: Sequence[str] = ("dp",),
                  bucket_mb: float = 25.0, units: Sequence[nn.Module] | None = None,
                  param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None
                  ) -> tuple[nn.Module, torch.optim.Optimizer]:
    """tessel's ZeRO for any nn.Module: returns (wrapped model, AdamW over what this rank owns).

    Stage 0 is plain data parallelism (tessel.parallel.data.data_parallel) with a full AdamW.
    `units` (stage 3) are the modules gathered as one; default: find_units(module).
    param_dtype / reduce_dtype (stages 1-3): the dtype the module computes with and the
    gradients are reduced in; the optimizer keeps fp32 masters (module docstring)."""
    if stage == 0:
        if param_dtype not in (None, torch.float32) or reduce_dtype not in (None, torch.float32):
            raise ValueError("param_dtype/reduce_dtype need ZeRO stage 1, 2 or 3 (fp32 masters)")
        model = data_parallel(module, mesh, axes, bucket_mb)
        params = dict.fromkeys(p for p in module.parameters() if p.requires_grad)
        return model, torch.optim.AdamW(decay_groups(params, decay, weight_decay), lr=lr, betas=betas, eps=eps)
    model = ZeroDataParallel(module, mesh, stage, axes, bucket_mb, units, param_dtype=param_dtype,
                             reduce_dtype=reduce_dtype)
    return model, ZeroAdamW(model, lr, betas, eps, weight_decay, decay)


def zero_dtypes(parallel) -> dict[str, torch.dtype | None]:
    """zero_parallel's param_dtype/reduce_dtype from a ParallelConfig."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}
    return {"param_dtype": dtypes[parallel.zero_param_dtype], "reduce_dtype": dtypes[parallel.zero_reduce_dtype]}
