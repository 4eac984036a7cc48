"""The cohort: the ranks that run Trainer.fit together, and every way they cooperate.

The trainer's loop is the same for every layout; what differs is who shares
the work and how ranks agree. A Cohort says it: which shard of the data a
rank reads, how a step's gradients become the next weights and what every
rank agrees on after it (skip a non-finite step, stop on a signal), how a
validation loss is combined, and which checkpoint writer, heartbeat and
straggler check the guard gets. The trainer and its guard ask the cohort and
never which layout runs.

Two cohorts: every rank of a device mesh (tessel.train.mesh_cohort), and a
parameter server's workers (tessel.train.ps.trainer).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from tessel.config import Config, FaultConfig
from tessel.heartbeat import Heartbeat
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.manager import CheckpointManager
from tessel.train.checkpoint.optimizer_state import OptimizerState
from tessel.train.checkpoint.tensors import StateTensors
from tessel.train.state import TrainState

Shard = tuple[int, int]  # (this rank's shard, number of shards) of a global batch


@dataclass
class StepOutcome:
    """What a step's update reports, the same on every rank that agreed on it."""
    loss: float  # the step's loss over the cohort
    lr: float  # the learning rate the update used
    grad_norm: float | None  # the global gradient norm; None where the update does not see it
    skipped: bool | None  # the update was skipped (non-finite); None where it cannot be
    stop_signal: int  # the signal the cohort stops on after this step, 0 for none


class PendingOutcome(Protocol):
    """A step's outcome on its way to the host (tessel.train.overlap): the trainer reads it once the next step
    is queued, so that on a GPU the host never waits for the device to drain."""

    def read(self) -> StepOutcome:
        """The outcome (on a GPU, waits for the step's copy to land)."""


@dataclass
class Known:
    """An outcome the host holds already (the parameter server's, whose update is done on the host)."""
    outcome: StepOutcome

    def read(self) -> StepOutcome:
        return self.outcome


class Cohort(Protocol):
    device: torch.device

    def shards(self) -> tuple[Shard, Shard]:
        """This rank's shard of the training batches and of the validation batches."""

    def sequence_columns(self, seq_len: int) -> list[int] | None:
        """The positions of every sequence this rank reads (its context-parallel chunks); None: all of them."""

    def update(self, state: TrainState, loss: torch.Tensor, stop_signal: int) -> PendingOutcome:
        """After the runner's backward, with this rank's loss: the update applied (or skipped), the
        learning-rate schedule advanced, the step's loss and decisions agreed, on their way to the host."""

    def eval_mean(self, loss: torch.Tensor) -> torch.Tensor:
        """A validation loss over this rank's validation shard -> the one the run reports."""

    def total(self, value: float) -> float:
        """Summed over the cohort's ranks (every rank's peak FLOP/s, for MFU)."""

    def state_tensors(self, runner: Runner, optimizer: OptimizerState) -> StateTensors:
        """Where the training state's tensors live, for checkpoints."""

    def checkpoints(self, root: Path, cfg: Config, run_id: str | None) -> CheckpointManager:
        """This rank's checkpoint writer (collective? alone? not at all?)."""

    def heartbeat(self, rank: int, f: FaultConfig) -> Heartbeat:
        """This rank's heartbeat, started, and whose beats it watches."""

    def forward_times(self, local: float) -> list[float] | None:
        """Every rank's forward time, to name stragglers; None: ranks are not compared."""
