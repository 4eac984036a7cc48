"""How a checkpoint holds an optimizer's state: per parameter, or as the optimizer hands it over.

torch's optimizers (the trainer's AdamW) keep their state per parameter
(`optimizer.state[p]`), so that state is sharded exactly like its parameter:
PerParameterState names it `optim/<param name>/<key>` and makes it a logical
tensor with the parameter's own marks, read back in the same DCP pass as the
model. A strategy whose optimizer keeps state in shards no parameter describes
(ZeRO's flat buffers) brings a CheckpointableOptimizer
(tessel.parallel.runner) that converts to and from logical tensors itself:
OwnState hands the checkpoint what it gives and lets it read afterwards.
The trainer picks one when it picks the optimizer; nothing here asks which.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch
import torch.nn as nn

from tessel.parallel.adamw import step_count
from tessel.parallel.runner import CheckpointableOptimizer
from tessel.train.checkpoint.logical import (OPTIM_PREFIX, LogicalView, check_shapes, copy_local_, is_distributed,
                                             unique_params)

PutBack = tuple[str, Callable[[torch.Tensor], None]]  # (fqn, what to do with the loaded tensor)


class OptimizerState(Protocol):
    """The optimizer's side of a checkpoint (tessel.train.checkpoint.tensors.LocalTensors calls it)."""

    def tensors(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """`optim/...` (and `model/...` it overrides) as local tensors; named: the runner's tensors."""

    def model_names(self) -> set[str]:
        """The `model/` names it restores itself."""

    def targets(self, named: dict[str, torch.Tensor], view: LogicalView,
                saved: dict) -> tuple[dict[str, torch.Tensor], list[PutBack]]:
        """What it reads in the model's DCP pass; CheckpointError, before anything is read, for a shape
        that differs from this run's. saved: fqn -> TensorStorageMetadata."""

    def load_own(self, reader, metadata, view: LogicalView) -> None:
        """What it reads by itself once that pass is done."""


class PerParameterState:
    """A torch optimizer's state, keyed and sharded by the parameter it belongs to."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def tensors(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        # under every name of a tied weight: a pipeline's last stage holds the head as a copy of its own,
        # whose state it reads by the head's name (tessel.parallel.pipeline.grad_sync.TiedEmbedding)
        out = {}
        for name, p in named.items():
            if not isinstance(p, nn.Parameter):
                continue
            for key, value in self.optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value):
                    raise TypeError(f"optimizer state {name}/{key} is a {type(value).__name__}, not a tensor")
                out[f"{OPTIM_PREFIX}{name}/{key}"] = value
        return out

    def model_names(self) -> set[str]:
        return set()

    def targets(self, named, view, saved):
        params = unique_params(named)
        check_shapes(saved, {}, {name: view.logical_shape(p, p, name) for name, p in params.items()})
        targets, put_back = {}, []
        for name, p in params.items():
            prefix = f"{OPTIM_PREFIX}{name}/"
            for fqn in (f for f in saved if f.startswith(prefix)):
                md = saved[fqn]
                if md.size != torch.Size([]):  # shaped like p (checked above)
                    targets[fqn] = view.empty_like_logical(p, fqn, dtype=md.properties.dtype)
                else:  # the step count
                    targets[fqn] = torch.zeros(md.size, dtype=md.properties.dtype, device=p.device)
                put_back.append((fqn, lambda t, p=p, key=fqn[len(prefix):]: self._set(p, key, t)))
        return targets, put_back

    def _set(self, p: torch.Tensor, key: str, loaded: torch.Tensor) -> None:
        local = torch.zeros_like(p, dtype=loaded.dtype) if is_distributed(loaded) else None
        if local is not None:
            copy_local_(local, loaded)
        if key == "step":  # where this optimizer's kernel reads it (fused: on the device)
            self.optimizer.state[p][key] = step_count(self.optimizer, p, loaded)
            return
        self.optimizer.state[p][key] = local if local is not None else loaded.clone()

    def load_own(self, reader, metadata, view) -> None:
        return None  # everything came in the model's pass


class OwnState:
    """A CheckpointableOptimizer (ZeRO's): its tensors as it hands them over, read back by itself."""

    def __init__(self, optimizer: CheckpointableOptimizer):
        self.optimizer = optimizer

    def tensors(self, named: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.optimizer.checkpoint_tensors()

    def model_names(self) -> set[str]:
        return self.optimizer.checkpoint_model_names()

    def targets(self, named, view, saved):
        return {}, []  # it reads whole logical tensors after the model's pass (load_own)

    def load_own(self, reader, metadata, view) -> None:
        # it reads logical tensors; local_slice cuts this rank's tp/ep shard of one
        self.optimizer.load_checkpoint_tensors(reader, metadata, localize=view.local_slice)
