"""Where a checkpoint's tensors come from, and where they go back to.

The checkpoint manager (tessel.train.checkpoint.manager) does the writing and
reading (DCP, atomic commit, checksums); a StateTensors says what is written
and how loaded tensors return. LocalTensors: the runner's parameters and
buffers, the optimizer's state and the RNG, on this rank, as logical tensors
(every layout of the trainer). A parameter-server run's state is on its
servers: tessel.train.ps.checkpoint.ServerSnapshot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from tessel.parallel.runner import Runner
from tessel.train.checkpoint.logical import LogicalView, as_logical, check_shapes, copy_local_, model_tensors
from tessel.train.checkpoint.optimizer_state import OptimizerState, PutBack
from tessel.train.checkpoint.safe_dcp import SafeReader


class StateTensors(Protocol):
    def save_tensors(self, view: LogicalView) -> tuple[dict[str, torch.Tensor], dict]:
        """(the tensors DCP writes, what the manifest records about them beyond the training state);
        collective where the layout's state is spread over ranks."""

    def load_targets(self, view: LogicalView, saved: dict) -> tuple[dict[str, torch.Tensor], list[PutBack]]:
        """DCP targets for this rank's tensors and how each goes back; CheckpointError, before anything is
        read, for a shape that differs from this run's. saved: fqn -> TensorStorageMetadata."""

    def after_load(self, path: Path, metadata, manifest: dict, view: LogicalView) -> None:
        """What is restored once the targets are back (state read by its owner, counters)."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class LocalTensors:
    """The training state this rank holds: its part of the model, its optimizer's state, its RNG."""

    def __init__(self, runner: Runner, optimizer: OptimizerState):
        self.runner, self.optimizer = runner, optimizer

    def save_tensors(self, view: LogicalView) -> tuple[dict[str, torch.Tensor], dict]:
        named = model_tensors(self.runner)
        owned = self.optimizer.model_names()  # its storage may be sharded (ZeRO-3): it hands those over itself
        state = {f"model/{k}": view.to_logical(v, v, k) for k, v in named.items() if k not in owned}
        # the optimizer's, shaped like their parameters: sharded like them
        state.update({k: as_logical(view, named, k, t) for k, t in self.optimizer.tensors(named).items()})
        state[f"rng/{_rank()}/cpu"] = torch.get_rng_state()
        if view.mesh.device.type == "cuda":
            state[f"rng/{_rank()}/cuda"] = torch.cuda.get_rng_state(view.mesh.device)
        return state, {}

    def load_targets(self, view: LogicalView, saved: dict) -> tuple[dict[str, torch.Tensor], list[PutBack]]:
        named = model_tensors(self.runner)
        owned = self.optimizer.model_names()  # its storage may be sharded (ZeRO-3): it loads those itself
        model = {k: v for k, v in named.items() if k not in owned}
        check_shapes(saved, {k: view.logical_shape(v, v, k) for k, v in model.items()}, {})
        targets, put_back = self.optimizer.targets(named, view, saved)
        for k, v in model.items():
            targets[f"model/{k}"] = view.empty_like_logical(v, k)
            put_back.append((f"model/{k}", lambda t, v=v: copy_local_(v, t)))
        for kind in ("cpu", "cuda"):
            fqn = f"rng/{_rank()}/{kind}"
            if fqn in saved and (kind == "cpu" or view.mesh.device.type == "cuda"):
                targets[fqn] = torch.zeros(saved[fqn].size, dtype=torch.uint8)
                put_back.append((fqn, lambda t, kind=kind: _set_rng(kind, t, view.mesh.device)))
        return targets, put_back

    def after_load(self, path: Path, metadata, manifest: dict, view: LogicalView) -> None:
        self.optimizer.load_own(SafeReader(path), metadata, view)


def _set_rng(kind: str, state: torch.Tensor, device) -> None:
    if kind == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state, device)
