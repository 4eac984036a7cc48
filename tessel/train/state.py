"""The training state: what a checkpoint saves and restores and a rollback rewinds.

The trainer builds it and hands it to its guard and, through the guard, to the
checkpoint manager (as torchtitan's trainer hands its checkpointer the
dataloader, model parts, optimizers and schedulers): nobody reads it off the
trainer. Its tensors (parameters, optimizer state) are reached through
`tensors`, which knows where they live (tessel.train.checkpoint.tensors); the
rest is plain values that the manifest holds beside them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import torch

from tessel.config import Config
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.tensors import StateTensors
from tessel.train.data import BatchSampler


@dataclass
class TrainState:
    run_id: str | None  # the run that owns this state's checkpoints (tessel.train.run_dir); None: no owner
    runner: Runner
    optimizer: torch.optim.Optimizer  # what the trainer steps: its param groups carry the learning rate
    scheduler: torch.optim.lr_scheduler.LRScheduler
    sampler: BatchSampler  # the position in the training data
    tensors: StateTensors  # the parameters' and the optimizer's tensors, wherever they live
    step: int = 0  # the next step to run

    def manifest_info(self, cfg: Config, world_size: int) -> dict:
        """The plain values a checkpoint's manifest holds beside the tensors: the run's model and layout,
        the data position, the schedule and the optimizer's hyper-parameters."""
        groups = [{k: v for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        return {"world_size": world_size, "model": cfg.model.model_dump(),
                "layout": {**cfg.parallel.model_dump(), "grad_accum": cfg.train.grad_accum},
                "global_batch": cfg.train.global_batch, "sampler": self.sampler.state_dict(),
                "scheduler": _plain(self.scheduler.state_dict()), "param_groups": _plain(groups)}

    def restore(self, manifest: dict) -> None:
        """The plain values of a checkpoint's manifest (its tensors are loaded by the checkpoint manager)."""
        for group, saved in zip(self.optimizer.param_groups, manifest["param_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        self.scheduler.load_state_dict(manifest["scheduler"])
        self.sampler.load_state_dict(manifest["sampler"])
        self.step = int(manifest["step"])


def _plain(obj):
    """JSON-safe copy of a state dict made of numbers, strings, lists and dicts (else TypeError)."""
    return json.loads(json.dumps(obj, default=_refuse))


def _refuse(o):
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"{type(o).__name__} does not belong in a JSON manifest")
