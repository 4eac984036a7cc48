"""The cohort of every rank of a device mesh: each step is one SPMD step over the mesh.

Plain, DP, TP, PP, EP, CP and ZeRO runs: every rank reads its data shard (ranks
that hold the same shard, tp, cp and pp peers, read the same rows; cp peers each
their own chunks of them), losses are averaged over the ranks that see
different tokens (dp x ep x cp), the gradient norm is taken and
clipped over the mesh, every rank steps its own optimizer, and all ranks
agree in one all-reduce on skipping a non-finite step and on stopping. None of
it waits for the host: the skip is decided by the fused AdamW on the device
(tessel.parallel.adamw.step_unless) and the step's numbers reach the host in
one copy read later (tessel.train.overlap).
Checkpoints are written by all ranks together; every rank's heartbeat is
watched by every other; forward times are compared across all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.axes import TOKEN_AXES
from tessel.config import Config, FaultConfig
from tessel.heartbeat import Heartbeat
from tessel.mesh import Mesh
from tessel.parallel.adamw import skips_on_device, step_unless
from tessel.parallel.context import layout
from tessel.parallel.norms import clip_grad_norm_
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.manager import CheckpointManager
from tessel.train.checkpoint.optimizer_state import OptimizerState
from tessel.train.checkpoint.tensors import LocalTensors, StateTensors
from tessel.train.cohort import Shard, StepOutcome
from tessel.train.fault.numerics import Agreement, agreed_values
from tessel.train.fault.stragglers import gather_times
from tessel.train.optim import optimizer_params
from tessel.train.overlap import HostCopy
from tessel.train.state import TrainState


def mean_over(value: torch.Tensor, mesh: Mesh, *axes: str) -> torch.Tensor:
    group = mesh.group(*axes)
    if group is not None:
        dist.all_reduce(value, group=group)
        value = value / mesh.size(*axes)
    return value


def step_if_finite(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    """The update unless `bad` (agreed: some rank's loss or norm is not finite). A fused AdamW decides on the
    device; another optimizer's step needs the flag on the host (free on the CPU, a wait on a GPU)."""
    if skips_on_device(optimizer):
        step_unless(optimizer, bad)
    elif not bad.item():
        optimizer.step()


@dataclass
class Agreed:
    """A mesh step's outcome on its way to the host: the agreed values' copy and the learning rate it used."""
    values: HostCopy
    lr: float

    def read(self) -> StepOutcome:
        agreed = Agreement.of(self.values.read())
        return StepOutcome(agreed.loss, self.lr, agreed.grad_norm, not agreed.finite, agreed.stop_signal)


class MeshCohort:
    """Every rank of `mesh` (the whole world) runs each step together."""

    def __init__(self, mesh: Mesh, grad_clip: float):
        self.mesh, self.grad_clip = mesh, grad_clip
        self.device = mesh.device

    def shards(self) -> tuple[Shard, Shard]:
        shard = (self.mesh.local_rank_in("dp", "ep"), self.mesh.size("dp", "ep"))
        return shard, shard

    def sequence_columns(self, seq_len: int) -> list[int] | None:
        """Context parallelism: this rank's chunks of every sequence (tessel.parallel.context.layout)."""
        cp = self.mesh.size("cp")
        return layout.positions(seq_len, cp, self.mesh.coord("cp")) if cp > 1 else None

    def update(self, state: TrainState, loss: torch.Tensor, stop_signal: int) -> Agreed:
        loss = mean_over(loss.float(), self.mesh, *TOKEN_AXES)
        # the norm is over what the optimizer steps (a sharded optimizer's gradients are marked)
        grad_norm = clip_grad_norm_(optimizer_params(state.optimizer), self.grad_clip, self.mesh)
        lr = state.optimizer.param_groups[0]["lr"]
        values = agreed_values(loss, grad_norm, stop_signal, self.device)
        step_if_finite(state.optimizer, values[0])
        state.scheduler.step()
        # set_to_none=False keeps gradients as views of the data-parallel buckets
        state.optimizer.zero_grad(set_to_none=False)
        return Agreed(HostCopy(values), lr)

    def eval_mean(self, loss: torch.Tensor) -> torch.Tensor:
        return mean_over(loss, self.mesh, *TOKEN_AXES)

    def total(self, value: float) -> float:
        """Summed over every rank, so MFU compares the whole run with the whole machine."""
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.item())

    def state_tensors(self, runner: Runner, optimizer: OptimizerState) -> StateTensors:
        return LocalTensors(runner, optimizer)

    def checkpoints(self, root: Path, cfg: Config, run_id: str | None) -> CheckpointManager:
        c = cfg.checkpoint
        return CheckpointManager(root, self.mesh, c.keep, c.async_save, run_id=run_id)

    def heartbeat(self, rank: int, f: FaultConfig) -> Heartbeat:
        world = dist.get_world_size() if dist.is_initialized() else 1
        beat = Heartbeat(rank, world, f.heartbeat_s, f.hang_timeout_s, f.kill_stalled)
        return beat.start() if f.heartbeat_s > 0 else beat

    def forward_times(self, local: float) -> list[float] | None:
        return gather_times(local, self.device)
