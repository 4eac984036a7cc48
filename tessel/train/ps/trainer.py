"""`tessel train` with parallel.dp_arch = "ps": dp workers and ps_servers parameter servers.

Ranks 0 .. dp-1 are workers, ranks dp .. dp+ps_servers-1 servers. Servers own
key ranges of the parameters and apply the trainer's optimizer there: AdamW
without decay on vectors, warm-up then cosine learning rate, gradient
clipping (tessel.parallel.ps.parameter_server); they run their serving loop
until every worker is done. Under BSP that is the arithmetic of all-reduce
DP; ASP and SSP let workers run ahead (SSP by at most parallel.ps_staleness
steps).

Workers run the trainer's own loop (tessel.train.trainer.Trainer.fit: progress,
metrics, checkpoints, stopping on a signal with a preemption checkpoint,
resuming) with a WorkerRunner (tessel.parallel.ps.worker: forward and
backward, push the gradients, pull the weights) and their own cohort,
WorkerCohort: the workers form a dp mesh of their own, without the servers.
- Each reads its dp shard of every global batch (the same shards as
  all-reduce DP). Under BSP the logged loss is the mean over workers and they
  agree to stop after the same step (they move in lockstep anyway); under ASP
  and SSP it is worker 0's own and each stops on its own signal (any
  collective would make them wait for each other).
- Validation runs on the whole global batch and sampling on worker 0's copy of
  the weights; MFU counts the workers' peak FLOP/s (the servers do no model
  flops).
- Checkpoints are written by worker 0 alone from a snapshot of the servers, in
  the all-reduce trainer's format (tessel.train.ps.checkpoint); the servers
  restore theirs before serving.
- Workers beat every fault.heartbeat_s without watching each other; servers
  drop a worker whose beat stops for fault.hang_timeout_s and go on. Forward
  times are not compared.

The workers' trainer keeps an AdamW over its copy of the parameters that it
never steps: its param groups and schedule are the servers' hyper-parameters
and learning rate, which rows and checkpoint manifests record.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.axes import AXES
from tessel.config import Config, FaultConfig, TrainConfig
from tessel.heartbeat import Heartbeat
from tessel.mesh import Mesh
from tessel.models.build import build_model
from tessel.models.family import model_family
from tessel.models.gpt import cross_entropy
from tessel.models.moe import with_aux_losses
from tessel.parallel.compile import compile_for_training
from tessel.parallel.fused_loss.apply import LogitsOf, fuse_model_head
from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.parallel.ps.worker import WorkerRunner
from tessel.parallel.runner import LocalRunner, Runner
from tessel.train.checkpoint.manager import CheckpointManager
from tessel.train.checkpoint.optimizer_state import OptimizerState
from tessel.train.checkpoint.tensors import StateTensors
from tessel.train.cohort import Known, Shard, StepOutcome
from tessel.train.fault.numerics import agree
from tessel.train.fault.preempt import Stopped, StopRequest
from tessel.train.mesh_cohort import mean_over
from tessel.train.optim import build_optimizer, lr_at
from tessel.train.ps.checkpoint import STATE_KEYS, ServerSnapshot, restore_servers
from tessel.train.state import TrainState
from tessel.train.trainer import Summary, Trainer

log = logging.getLogger("tessel.ps")


def server_optimizer(pieces: list[nn.Parameter], t: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's AdamW on a server's (flat) pieces: decay by the dimension of the parameter
    each piece was cut from, so vectors get none."""
    return build_optimizer(pieces, t, decay=lambda q: q.ps_source_dim >= 2)


def roles(cfg: Config) -> tuple[list[int], list[int]]:
    """(workers, servers): workers first, so rank 0 (which reports) is a worker."""
    p = cfg.parallel
    return list(range(p.dp)), list(range(p.dp, p.dp + p.ps_servers))


def worker_mesh(cfg: Config, device: torch.device) -> Mesh:
    """The workers as a dp mesh (ranks 0 .. dp-1); collective: servers make its groups too."""
    sizes = {**{a: 1 for a in AXES}, "dp": cfg.parallel.dp}
    return Mesh(sizes, rank=dist.get_rank(), device=device).build_groups()


class WorkerCohort:
    """A parameter server's workers (tessel.train.cohort.Cohort): the servers apply the update."""

    def __init__(self, cfg: Config, mesh: Mesh, ps: ParameterServer, model: nn.Module):
        self.cfg, self.mesh, self.ps, self.model = cfg, mesh, ps, model
        self.device = mesh.device
        self.lockstep = cfg.parallel.ps_mode == "bsp"

    def shards(self) -> tuple[Shard, Shard]:
        # validation on the whole batch: worker 0 alone reports it
        return (self.mesh.local_rank_in("dp"), self.mesh.size("dp")), (0, 1)

    def sequence_columns(self, seq_len: int) -> list[int] | None:
        return None  # workers hold whole models and read whole sequences

    def update(self, state: TrainState, loss: torch.Tensor, stop_signal: int) -> Known:
        """The runner's push had the servers apply it; the schedule advances with theirs."""
        lr = state.optimizer.param_groups[0]["lr"]
        loss = loss.float()
        group = self.mesh.group("dp")  # None for a single worker
        if self.lockstep and group is not None:
            loss = mean_over(loss, self.mesh, "dp")
            # nothing to skip (the update is applied already): one all-reduce for the stop decision
            stop_signal = agree(loss, torch.zeros((), device=self.device), stop_signal, self.device, group).stop_signal
        with warnings.catch_warnings():  # "scheduler stepped before the optimizer": the servers stepped
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step()`")
            state.scheduler.step()
        return Known(StepOutcome(loss.item(), lr, None, None, stop_signal))

    def eval_mean(self, loss: torch.Tensor) -> torch.Tensor:
        return loss  # each worker's own weights; worker 0's is reported

    def total(self, value: float) -> float:
        return value * self.mesh.size("dp")  # the same devices everywhere; servers do no model flops

    def state_tensors(self, runner: Runner, optimizer: OptimizerState) -> StateTensors:
        return ServerSnapshot(self.ps, runner, self.model, self.cfg.parallel.ps_mode)

    def checkpoints(self, root: Path, cfg: Config, run_id: str | None) -> CheckpointManager:
        c = cfg.checkpoint
        return CheckpointManager(root, self.mesh, c.keep, c.async_save, run_id=run_id, alone=True,
                                 writes=self.mesh.local_rank_in("dp") == 0)

    def heartbeat(self, rank: int, f: FaultConfig) -> Heartbeat:
        """The parameter server's own beat, which the servers watch (workers do not watch each other);
        a silent one where it has none (no hang timeout)."""
        if self.ps.heartbeat is not None:
            return self.ps.heartbeat
        return Heartbeat(rank, 1, f.heartbeat_s, f.hang_timeout_s)

    def forward_times(self, local: float) -> list[float] | None:
        return None


def train_rank_ps(cfg: Config, device: torch.device, run_id: str | None = None,
                  stop: StopRequest | None = None) -> Summary | None:
    """One rank of a parameter-server run; a worker returns its Summary, a server None."""
    p, t = cfg.parallel, cfg.train
    workers, servers = roles(cfg)
    torch.manual_seed(t.seed)  # the same initial weights everywhere (the servers' copy is broadcast too)
    model = build_model(cfg.model).to(device)
    mesh = worker_mesh(cfg, device)
    ps = ParameterServer(model, servers, workers, p.ps_mode, p.ps_staleness,
                         optimizer=lambda pieces: server_optimizer(pieces, t), grad_clip=t.grad_clip,
                         lr_at=lambda step: lr_at(step, t), state_keys=STATE_KEYS,
                         hang_timeout_s=cfg.fault.hang_timeout_s if cfg.fault.heartbeat_s > 0 else 0.0,
                         heartbeat_s=cfg.fault.heartbeat_s)
    if ps.is_server:
        serve(cfg, ps, model, run_id, stop or StopRequest())
        return None
    loss_fn, full_logits = cross_entropy, None
    if t.fused_loss:  # the head's matmul moves into the loss (tessel.parallel.fused_loss); sampling takes it back
        fused = fuse_model_head(model, cfg.model.vocab_size)
        loss_fn, full_logits = fused.loss, LogitsOf(model, fused)
    if cfg.model.n_experts:
        loss_fn = with_aux_losses(loss_fn, model)
    if t.compile != "off":  # the worker's model is whole: its blocks (or itself) compiled as in tessel.apply
        compile_for_training([model], cfg.parallel, t, model_family(cfg.model))
    local = LocalRunner(model, loss_fn, t.grad_accum * p.micro_batches, device, t.precision, full_logits=full_logits,
                        vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_seq_len)
    runner = WorkerRunner(local, ps, lead=dist.get_rank() == 0)
    trainer = Trainer(cfg, mesh, runner, dist.get_rank(), run_id=run_id, stop=stop,
                      cohort=WorkerCohort(cfg, mesh, ps, model))
    try:
        summary = trainer.fit()
    except Stopped:
        runner.finish()  # after its preemption checkpoint: the servers may stop once all are done
        raise
    runner.finish()  # after its last checkpoint is committed
    return summary


def serve(cfg: Config, ps: ParameterServer, model: nn.Module, run_id: str | None, stop: StopRequest) -> None:
    """A server: resume when asked, serve until every worker is done or dead. A stop signal does not
    end it early: it serves the workers until they stop (after their preemption checkpoint)."""
    restore_servers(cfg, ps, model, run_id)
    stats = ps.serve()
    log.info("ps server %d: %d updates, pushes %s, dead %s, max staleness %d", stats.rank, stats.updates,
             stats.pushes, stats.dead, stats.max_staleness)
    if stop.pending():
        raise Stopped(stop.pending(), stats.updates)
