"""What a rank holds now: the bytes of ZeRO's memory table, measured (tessel.parallel.zero.zero_parallel)."""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from tessel.parallel.zero.engine import ZeroDataParallel


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients and optimizer state.

    `model` is a ZeroDataParallel or any other module (plain data parallelism).
    Counts each storage once (views share one), at its allocated size: a
    stage-3 buffer that is freed counts 0."""
    groups = model.groups if isinstance(model, ZeroDataParallel) else []
    stepped = [p for group in optimizer.param_groups for p in group["params"]]
    params = list(model.parameters()) + [g.shard for g in groups] + stepped
    grads = ([p.grad for p in model.parameters()] + [g.buffer for g in groups] + [g.grad_shard for g in groups]
             + [p.grad for p in stepped])
    states = [v for st in optimizer.state.values() for k, v in st.items()
              if torch.is_tensor(v) and k != "step"]
    return {"params": _storage_bytes(params), "grads": _storage_bytes(grads), "optimizer": _storage_bytes(states)}


def _storage_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """The allocated bytes of the storages behind `tensors`, each storage once."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is not None:
            s = t.untyped_storage()
            seen[_storage_key(s)] = s.nbytes()
    return sum(seen.values())


def _storage_key(s: torch.UntypedStorage) -> int:
    """One key per storage, shared by its views. A meta storage (a dry run,
    tessel.testing.dryrun) has no address, so it is told apart by its C++ object."""
    if s.device.type == "meta":
        return s._cdata
    return s.data_ptr() if s.nbytes() else id(s)
