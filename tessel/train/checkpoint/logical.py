"""Layout-independent state: every tensor as its LOGICAL (unsharded) self.

A parameter sharded over mesh axes declares it (tessel.sharding: the axes and
{axis: tensor dim}). Here each
local shard becomes a DTensor over a torch DeviceMesh made from tessel's own
process groups, with Shard(dim) on the axes that split it and Replicate on the
rest. DCP then writes each logical tensor once, in chunks, and on load every
rank reads exactly the region its own (possibly different) layout needs:
dp2 -> dp4, tp2 -> tp1 x pp2, ... A new strategy only has to mark its params.

- Pipeline stages keep the full model's parameter names, so a stage simply
  holds a subset of the keys.
- Padded shards (a vocabulary padded to a multiple of tp) may carry
  `tessel_logical_shape`; the padding rows are dropped on save and left as
  they are on load.
- A packed shard (GPT-2's fused q|k|v split per head over tp,
  tessel.sharding.mark_packed) is several pieces of its logical tensor: it
  becomes a ShardedTensor of them (tessel.train.checkpoint.packed).
- Optimizer state is keyed by parameter name (`optim/<name>/<key>`), not by
  index, and is sharded like its parameter.
- Strategies whose state does not follow mark_sharded (flat ZeRO buffers)
  bring a CheckpointableOptimizer (tessel.parallel.runner) that hands over
  logical tensors by the same keys and reads them back itself
  (tessel.train.checkpoint.optimizer_state). Its tensors are whole over its
  own axes (dp) but may be tp or ep shards, shaped like their parameter: those
  become DTensors here like any marked parameter (as_logical), and on load
  `LogicalView.local_slice` cuts a rank's shard from the whole (a tp grid's
  block by its own placement).
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, Replicate, Shard

from tessel.axes import AXES
from tessel.mesh import Mesh
from tessel.parallel.runner import Runner, strip_wrappers
from tessel.sharding import logical_shape, packed_dims, placement, shard_axes, shard_dims
from tessel.train.checkpoint.manifest import CheckpointError
from tessel.train.checkpoint.packed import logical_size, packed_local, packed_slice, packed_tensor

OPTIM_PREFIX = "optim/"


def model_tensors(runner: Runner) -> dict[str, torch.Tensor]:
    """Name -> local parameter/persistent buffer, with the full model's names."""
    return dict(runner.named_checkpoint_tensors())


class LogicalView:
    """Turns local shards into DTensors (and back) for one mesh."""

    def __init__(self, mesh: Mesh):
        self.mesh = mesh
        self.axes = [a for a in AXES if mesh.size(a) > 1]
        self._dmesh = None

    @property
    def device_mesh(self):
        if self._dmesh is None:
            # built from tessel's own groups: no new process groups, no collective
            grid = self.mesh.grid().reshape([self.mesh.size(a) for a in self.axes])
            groups = [self.mesh.group(a) for a in self.axes]
            from torch.distributed.device_mesh import DeviceMesh
            self._dmesh = DeviceMesh.from_group(groups if len(groups) > 1 else groups[0], self.mesh.device.type,
                                                mesh=grid, mesh_dim_names=tuple(self.axes))
        return self._dmesh

    def _placements(self, like: torch.Tensor, name: str):
        axes = [a for a in shard_axes(like) if a in self.axes]
        if not axes:
            return None
        dims = shard_dims(like)
        missing = [a for a in axes if a not in dims]
        if missing:
            raise ValueError(f"{name} is sharded over {missing} without a tensor dim: "
                             "mark it with mark_sharded(p, axis, dim=...) to checkpoint it")
        return [Shard(dims[a]) if a in axes else Replicate() for a in self.axes]

    def _packed(self, like: torch.Tensor, name: str) -> tuple[str, int, tuple[int, ...]] | None:
        """(axis, dim, blocks) of a packed shard over one of this mesh's axes (and no other); None if unpacked."""
        packed = [(a, *dp) for a, dp in packed_dims(like).items() if a in self.axes]
        if not packed:
            return None
        if len(packed) > 1 or any(a in self.axes for a in shard_axes(like) if a != packed[0][0]):
            raise ValueError(f"{name} is packed over {packed[0][0]} and sharded over other axes too: not checkpointed")
        return packed[0]

    def logical_shape(self, local: torch.Tensor, like: torch.Tensor, name: str) -> torch.Size:
        own = placement(like)
        if own is not None:  # a tp grid's block (tessel.parallel.tensor_nd)
            return torch.Size(own.shape)
        packed = self._packed(like, name)
        if packed is not None:
            return logical_size(local.shape, packed[1], self.mesh.size(packed[0]))
        given = logical_shape(like)
        if given is not None:
            return torch.Size(given)
        shape = list(local.shape)
        dims = shard_dims(like)
        for a in shard_axes(like):
            if a in self.axes:
                shape[dims[a]] *= self.mesh.size(a)
        return torch.Size(shape)

    def to_logical(self, local: torch.Tensor, like: torch.Tensor, name: str) -> torch.Tensor:
        """local shard (of `like`'s layout) -> DTensor of the logical tensor, or the tensor if replicated."""
        own = placement(like)
        if own is not None:  # a tp grid's block: its own DTensor over the grid (tessel.parallel.tensor_nd)
            return own.as_dtensor(local.detach())
        packed = self._packed(like, name)
        if packed is not None:  # pieces of the logical tensor (tessel.train.checkpoint.packed)
            return packed_tensor(local.detach(), self.mesh, *packed)
        placements = self._placements(like, name)
        local = local.detach()
        if placements is None:
            return local
        shape = self.logical_shape(local, like, name)
        local = self._unpad(local, like, shape, name)
        stride = torch.empty(shape, device="meta").stride()
        return DTensor.from_local(local, self.device_mesh, placements, run_check=False, shape=shape, stride=stride)

    def _unpad(self, local: torch.Tensor, like: torch.Tensor, shape: torch.Size, name: str) -> torch.Tensor:
        """Drop the rows of a padded shard that lie past the logical size (DTensor's chunk layout)."""
        dims = shard_dims(like)
        for a in shard_axes(like):
            if a not in self.axes:
                continue
            d, n = dims[a], self.mesh.size(a)
            per = local.size(d)
            if per * n == shape[d]:
                continue
            if per != -(-shape[d] // n):
                raise ValueError(f"{name}: a {per}-row shard over {n} ranks cannot hold a logical size "
                                 f"{shape[d]} in DTensor's ceil-chunk layout")
            start = self.mesh.coord(a) * per
            local = local.narrow(d, 0, max(0, min(per, shape[d] - start)))
        return local

    def local_slice(self, full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the logical tensor `full`, in `like`'s local layout (DTensor's
        ceil-chunks; rows past the logical size, vocabulary padding, are zeros)."""
        own = placement(like)
        if own is not None:  # a tp grid's block: cut as its own DTensor holds it (tessel.parallel.tensor_nd)
            return own.local_slice(full)
        packed = self._packed(like, "")
        if packed is not None:
            axis, dim, blocks = packed
            return packed_slice(full, dim, blocks, self.mesh.size(axis), self.mesh.coord(axis))
        dims = shard_dims(like)
        out = full
        for a in shard_axes(like):
            if a not in self.axes:
                continue
            d, per = dims[a], like.size(dims[a])
            start = min(self.mesh.coord(a) * per, out.size(d))
            piece = out.narrow(d, start, min(per, out.size(d) - start))
            if piece.size(d) < per:
                pad = list(piece.shape)
                pad[d] = per - piece.size(d)
                piece = torch.cat([piece, piece.new_zeros(pad)], dim=d)
            out = piece
        return out

    def empty_like_logical(self, like: torch.Tensor, name: str, dtype=None) -> torch.Tensor:
        """A load target with `like`'s local layout (a DTensor when sharded)."""
        return self.to_logical(torch.zeros_like(like, dtype=dtype or like.dtype), like, name).detach()


def is_distributed(loaded: torch.Tensor) -> bool:
    """A load target that holds this rank's part of a logical tensor (a DTensor, or a packed shard's pieces)."""
    return isinstance(loaded, (DTensor, ShardedTensor))


def local_part(loaded: torch.Tensor) -> torch.Tensor:
    """This rank's part of a loaded target, in its local layout."""
    if isinstance(loaded, DTensor):
        return loaded.to_local()
    return packed_local(loaded) if isinstance(loaded, ShardedTensor) else loaded


def copy_local_(dst: torch.Tensor, loaded: torch.Tensor) -> None:
    """Write a loaded target back into a local tensor (padding rows stay as they are)."""
    src = local_part(loaded)
    with torch.no_grad():
        region = dst
        for d in range(src.dim()):
            if src.size(d) != dst.size(d):
                region = region.narrow(d, 0, src.size(d))
        region.copy_(src)


# ---- names ------------------------------------------------------------------------
def unique_params(named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """First name of every distinct parameter (tied embeddings appear once)."""
    seen, out = set(), {}
    for name, t in named.items():
        if id(t) not in seen and isinstance(t, nn.Parameter):
            seen.add(id(t))
            out[name] = t
    return out


def as_logical(view: LogicalView, named: dict[str, torch.Tensor], key: str, t: torch.Tensor) -> torch.Tensor:
    """An optimizer's tensor (model/<name> or optim/<name>/<key>) shaped like its parameter: a DTensor
    over the axes that parameter is marked sharded on (tp, ep); as it is otherwise (a step count)."""
    if key.startswith("model/"):
        name = key[len("model/"):]
    elif key.startswith(OPTIM_PREFIX):
        name = key[len(OPTIM_PREFIX):].rsplit("/", 1)[0]
    else:
        return t.detach()
    p = named.get(name)
    if p is None or tuple(t.shape) != tuple(p.shape):
        return t.detach()
    return view.to_logical(t, p, key)


def check_shapes(saved: dict, model: dict[str, torch.Size], params: dict[str, torch.Size]) -> None:
    """Before anything is read: every model tensor the run loads is in the checkpoint with its logical
    shape, and every optimizer state of a parameter that is not a scalar (AdamW's exp_avg, exp_avg_sq)
    has that parameter's shape. `saved`: fqn -> TensorStorageMetadata; model, params: name -> shape."""
    for name, want in model.items():
        fqn = f"model/{name}"
        if fqn not in saved:
            raise CheckpointError(f"the checkpoint has no '{name}' (its model differs from this one)")
        _same_shape(fqn, saved[fqn].size, want)
    for name, want in params.items():
        prefix = f"{OPTIM_PREFIX}{name}/"
        for fqn in (f for f in saved if f.startswith(prefix)):
            if saved[fqn].size != torch.Size([]):  # the step count is a scalar
                _same_shape(fqn, saved[fqn].size, want)


def _same_shape(fqn: str, got, want) -> None:
    if tuple(got) != tuple(want):
        raise CheckpointError(f"'{fqn}' has shape {list(got)} in the checkpoint, but this run's is {list(want)}")


def module_shapes(module: nn.Module) -> tuple[dict[str, torch.Size], dict[str, torch.Size]]:
    """(model tensors, parameters) -> logical shape, named as a checkpoint names them, for an unsharded
    module (one built on the meta device will do)."""
    named = {strip_wrappers(k): v for k, v in module.state_dict(keep_vars=True).items()}
    return ({k: v.shape for k, v in named.items()}, {k: p.shape for k, p in unique_params(named).items()})
