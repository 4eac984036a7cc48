"""Synchronous data parallelism: bucketed gradient all-reduce overlapped with backward.

The scheme of PyTorch DDP (Li et al. 2020, "PyTorch Distributed: Experiences on
Accelerating Data Parallel Training") and Horovod's tensor fusion: parameters
are grouped into buckets in reverse registration order (roughly the order in
which backward produces their gradients). Each gradient lives in a view of its
bucket's flat buffer, so autograd accumulates straight into the buffer; when the
last gradient of a bucket is ready, the bucket's all-reduce starts
asynchronously while backward goes on with earlier layers. The engine's final
callback waits for the reductions and divides by the group size.

Works on any nn.Module:

    model = data_parallel(model, mesh)            # reduce over mesh axis "dp"
    with model.no_sync():                         # accumulation micro-steps
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()             # grads are averaged here

Parameters sharded over one of the data axes (experts over ep, see
tessel.parallel.expert.expert_parallel) are summed only over the data axes that replicate
them, and still divided by the number of data shards: the all-to-all's backward
has already summed the contributions of the other ep ranks' tokens into them.

A parameter no rank used in a step keeps grad None on every rank, and one used on
some ranks only gets the reduced gradient on all, as under DDP with
find_unused_parameters (tessel.parallel.data.unused: the "no gradient" bit rides in
the all-reduce). With broadcast_buffers (the default, as DDP's) the first rank's
persistent buffers (BatchNorm's statistics) are broadcast before every forward that
a synchronised backward follows (tessel.parallel.data.broadcast).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.data.broadcast import BufferBroadcast, broadcast_by_axes, group_of
from tessel.parallel.data.unused import mark_no_gradient, may_go_unused, no_gradient
from tessel.sharding import shard_axes

# A reducer receives a flat buffer and a group and returns a waitable work
# handle; it sums in place. `native` is the backend's own all-reduce; the comm
# package registers ring and hierarchical algorithms under other names.
Reducer = Callable[[torch.Tensor, object], object]


def is_view(grad: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether `grad` already is `view` of a flat buffer (same storage, same place). Meta tensors
    (tessel.testing.dryrun) all have address 0, so their storages are told apart by object."""
    if grad.is_meta:
        return (grad.untyped_storage()._cdata == view.untyped_storage()._cdata
                and grad.storage_offset() == view.storage_offset())
    return grad.data_ptr() == view.data_ptr()


def native_all_reduce(buf: torch.Tensor, group) -> object:
    return dist.all_reduce(buf, group=group, async_op=True)


@dataclass
class Bucket:
    params: list[nn.Parameter]
    buffer: torch.Tensor
    offsets: list[int]
    axes: tuple[str, ...] = ()  # the mesh axes this bucket is summed over
    group: object = None
    pending: int = 0
    work: object = None
    ready: set[int] = field(default_factory=set)

    def view_of(self, i: int) -> torch.Tensor:
        p = self.params[i]
        return self.buffer[self.offsets[i]: self.offsets[i] + p.numel()].view(p.shape)


def build_buckets(params: Sequence[nn.Parameter], bucket_bytes: int,
                  first_bucket_bytes: int | None = None,
                  axes_of: Callable[[nn.Parameter], tuple[str, ...]] = lambda p: (),
                  align: int = 1) -> list[Bucket]:
    """Group params (already in expected gradient order) into flat buffers by dtype/device/axes.

    The first bucket is small (1 MiB by default, as in DDP): its gradients are the
    first ready, and a small bucket lets communication start early in backward.
    `axes_of(p)` names the mesh axes p's gradient is summed over; buckets never mix them.
    Each buffer is zero-padded to a multiple of `align` elements (ZeRO cuts it in equal shards).
    """
    first_bucket_bytes = min(bucket_bytes, first_bucket_bytes or 2**20)
    buckets: list[Bucket] = []
    open_by_key: dict[tuple, tuple[list, int]] = {}

    def close(key):
        plist, nbytes = open_by_key.pop(key)
        numels = [p.numel() for p in plist]
        offsets = [sum(numels[:i]) for i in range(len(numels))]
        buf = torch.zeros(-(-sum(numels) // align) * align, dtype=key[0], device=key[1])
        buckets.append(Bucket(plist, buf, offsets, axes=key[2]))

    for p in params:
        key = (p.dtype, p.device, axes_of(p))
        plist, nbytes = open_by_key.get(key, ([], 0))
        plist.append(p)
        nbytes += p.numel() * p.element_size()
        open_by_key[key] = (plist, nbytes)
        if nbytes >= (bucket_bytes if buckets else first_bucket_bytes):
            close(key)
    for key in list(open_by_key):
        close(key)
    return buckets


class GradientSyncWrapper(nn.Module):
    """A module wrapper whose backward reduces gradients unless inside no_sync()."""

    sync_gradients = True
    # whether a runner's accumulation micro-steps should skip the reduction (no_sync): yes
    # where the reduced gradient is as big as the unreduced one (DP, ZeRO-1); no where the
    # reduction shards it (ZeRO-2/3 keep 1/N of the gradients only if every micro-step
    # reduce-scatters into the owned shard)
    defer_reduction = True
    # broadcast_buffers: the first rank's buffers to every rank before a training forward (DDP's)
    buffer_sync: BufferBroadcast | None = None

    def forward(self, *args, **kwargs):
        # as DDP: only a forward whose backward reduces (grad enabled, not inside no_sync)
        if self.buffer_sync is not None and torch.is_grad_enabled() and self.sync_gradients:
            self.buffer_sync()
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the next backward outside this block reduces them all."""
        old, self.sync_gradients = self.sync_gradients, False
        try:
            yield
        finally:
            self.sync_gradients = old


class DataParallel(GradientSyncWrapper):
    """Wraps a module; its gradients are averaged over `axes` of the mesh after backward."""

    def __init__(self, module: nn.Module, mesh: Mesh, axes: Sequence[str] = ("dp",),
                 bucket_mb: float = 25.0, reducer: Reducer = native_all_reduce,
                 params: Sequence[nn.Parameter] | None = None, broadcast: bool = True,
                 broadcast_buffers: bool = True):
        super().__init__()
        self.module = module
        self.axes = tuple(axes)
        self.group = mesh.group(*self.axes)
        self.group_size = mesh.size(*self.axes)
        self.reducer = reducer
        self.sync_gradients = True
        if params is None:
            params = list(dict.fromkeys(p for p in module.parameters() if p.requires_grad))
        if broadcast and self.group is not None:
            self._broadcast(module, mesh)
        if broadcast_buffers and self.group is not None:
            self.buffer_sync = BufferBroadcast(module, mesh, self.axes)
        # reverse order approximates the order in which gradients become ready
        self.buckets = build_buckets(list(reversed(params)), int(bucket_mb * 2**20), axes_of=self.reduce_axes)
        for bucket in self.buckets:
            bucket.group = group_of(mesh, bucket.axes)
        self._where: dict[int, tuple[int, int]] = {}
        for b_idx, bucket in enumerate(self.buckets):
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (b_idx, i)
        self._next_to_launch = 0
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready)
                       for p in params] if self.group is not None else []

    def reduce_axes(self, p: nn.Parameter) -> tuple[str, ...]:
        """The data axes over which p is replicated (all of them unless p is sharded over one)."""
        return tuple(a for a in self.axes if a not in shard_axes(p))

    def _broadcast(self, module: nn.Module, mesh: Mesh) -> None:
        # every parameter (frozen ones too) and buffer, each from the first rank of the axes
        # that replicate it: shards stay distinct
        broadcast_by_axes(mesh, self.axes, [*module.parameters(), *module.buffers()])

    # ---- backward-time machinery --------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        b_idx, i = self._where[id(p)]
        bucket = self.buckets[b_idx]
        view = bucket.view_of(i)
        if not is_view(p.grad, view):
            # first gradient since zero_grad(set_to_none=True): move it into the bucket,
            # so later accumulations land in the buffer with no copy
            view.copy_(p.grad)
            p.grad = view
        if not self.sync_gradients:
            return
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)
        bucket.ready.add(i)
        if len(bucket.ready) == len(bucket.params):
            self._launch_ready_in_order()

    def _launch_ready_in_order(self) -> None:
        # every rank must issue its collectives in the same order: launch by bucket index
        while self._next_to_launch < len(self.buckets):
            bucket = self.buckets[self._next_to_launch]
            if len(bucket.ready) < len(bucket.params):
                return
            bucket.work = self.reducer(bucket.buffer, bucket.group) if bucket.group is not None else None
            self._next_to_launch += 1

    def _finish(self) -> None:
        # parameters that got no gradient this backward still take part, as "no gradient"
        # (-0.0, tessel.parallel.data.unused), so every rank reduces the same buckets
        for bucket in self.buckets:
            for i, p in enumerate(bucket.params):
                if i not in bucket.ready:
                    view = bucket.view_of(i)
                    if p.grad is None or not is_view(p.grad, view):
                        mark_no_gradient(view) if p.grad is None else view.copy_(p.grad)
                        p.grad = view
                    bucket.ready.add(i)
        self._launch_ready_in_order()
        for bucket in self.buckets:
            if bucket.work is not None:
                bucket.work.wait()
            bucket.buffer.div_(self.group_size)
            bucket.work = None
            bucket.ready.clear()
        self._next_to_launch = 0
        self._callback_queued = False
        self._drop_unused()

    def _drop_unused(self) -> None:
        """A parameter no rank used keeps grad None, as without data parallelism (AdamW skips it)."""
        params = [p for bucket in self.buckets for p in bucket.params if may_go_unused(p)]
        for p, unused in zip(params, no_gradient([p.grad for p in params])):
            if unused:
                p.grad = None


def data_parallel(module: nn.Module, mesh: Mesh, axes: Sequence[str] = ("dp",), bucket_mb: float = 25.0,
                  reducer: Reducer = native_all_reduce, broadcast_buffers: bool = True) -> DataParallel:
    """tessel's data parallelism for any nn.Module. See the module docstring.

    broadcast_buffers: as DDP's, the first rank's persistent buffers to every rank before
    each forward that a synchronised backward follows (tessel.parallel.data.broadcast)."""
    return DataParallel(module, mesh, axes, bucket_mb, reducer, broadcast_buffers=broadcast_buffers)
