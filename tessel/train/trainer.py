"""The training loop that every rank runs, whatever the layout: data -> runner -> update -> metrics.

The runner (tessel.parallel.runner.Runner) computes; the cohort
(tessel.train.cohort) says how this rank's peers share the data and agree and
how the update is applied (this rank's optimizer over a mesh, or a parameter
server's); the guard (tessel.train.fault.guard) checkpoints, watches and
recovers the TrainState (tessel.train.state) the trainer hands it. Parameter-
server workers run this same loop (tessel.train.ps_trainer).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.config import Config, TrainConfig
from tessel.heartbeat import log
from tessel.mesh import Mesh
from tessel.models.build import build_model
from tessel.models.flops import training_flops_per_token
from tessel.models.gpt import count_params
from tessel.observe.metrics import MetricsLog, device_peak_flops, peak_memory_mb
from tessel.observe.progress import Progress
from tessel.observe.trackers import open_trackers
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.optimizer_state import OptimizerState, OwnState, PerParameterState
from tessel.train.cohort import Cohort
from tessel.train.data import BatchSampler, load_tokens, text_codec
from tessel.train.fault.elastic import Replanned
from tessel.train.fault.guard import Guard, checkpoint_root
from tessel.train.fault.injection import FaultInjector
from tessel.train.fault.preempt import Stopped, StopRequest
from tessel.train.mesh_cohort import MeshCohort
from tessel.train.optim import build_optimizer, build_scheduler, optimizer_params
from tessel.train.state import TrainState


@dataclass
class Summary:
    steps: int
    losses: list[float]
    val_loss: float | None
    tokens_per_s: float
    mfu: float
    peak_mem_mb: float
    params: int
    sample: str = ""
    files: dict[str, str] = field(default_factory=dict)


def sample_text(runner, cfg: Config) -> str:
    """train.sample_tokens tokens generated from train.sample_prompt ("" when 0), encoded and decoded by
    data.tokenizer (bytes by default); collective over the runner."""
    t = cfg.train
    if t.sample_tokens == 0:
        return ""
    codec = text_codec(cfg.data)
    prompt = torch.tensor([codec.encode(t.sample_prompt)], dtype=torch.long) % cfg.model.vocab_size
    out = runner.generate(prompt, t.sample_tokens, seed=t.seed)
    return codec.decode(out[0].tolist())


def speed_fields(elapsed: float, tokens: int, flops_per_token: float, peak_flops: float,
                 device: torch.device) -> dict[str, float]:
    """A step's throughput fields of the metrics row: time, tokens/s, MFU, peak memory."""
    return {"step_time_s": elapsed, "tokens_per_s": tokens / elapsed,
            "mfu": flops_per_token * tokens / elapsed / peak_flops, "peak_mem_mb": peak_memory_mb(device)}


def close_log(log: MetricsLog, tensorboard: bool = True, summary: dict | None = None) -> dict[str, str]:
    """Close rank 0's metrics log (its trackers get `summary`) and plot its curves; the files the run wrote."""
    from tessel.observe.plots import plot_metrics  # deferred: matplotlib, for the run's last moment
    log.close(summary)
    files = {"metrics": str(log.path)}
    if tensorboard:
        files["tensorboard"] = str(Path(log.dir) / "tensorboard")
    files["curves"] = str(plot_metrics(log.path, Path(log.dir) / "curves.png"))
    return files


def summarize(history: list[dict], val_loss: float | None, n_params: int, sample: str,
              files: dict[str, str]) -> Summary:
    """The run's Summary from its metrics rows; the first steps pay for warm-up (allocations,
    thread pools) and are left out of the medians."""
    steady = history[min(2, len(history) - 1):]
    return Summary(steps=len(history), losses=[r["loss"] for r in history], val_loss=val_loss,
                   tokens_per_s=statistics.median(r["tokens_per_s"] for r in steady),
                   mfu=statistics.median(r["mfu"] for r in steady),
                   peak_mem_mb=max(r["peak_mem_mb"] for r in history), params=n_params,
                   sample=sample, files=files)


def tracker_summary(summary: Summary) -> dict:
    """What the experiment trackers keep of a finished run."""
    return {"steps": summary.steps, "final_loss": summary.losses[-1], "val_loss": summary.val_loss,
            "tokens_per_s": summary.tokens_per_s, "mfu": summary.mfu, "peak_mem_mb": summary.peak_mem_mb,
            "params": summary.params}


class Trainer:
    """One rank's training loop, the same for every layout: the runner computes, the cohort
    (tessel.train.cohort) says how ranks share the data and agree, the guard checkpoints and recovers.

    cohort: None for every rank of `mesh` (MeshCohort); a parameter server's workers bring theirs."""

    def __init__(self, cfg: Config, mesh: Mesh, runner: Runner, rank: int = 0, run_id: str | None = None,
                 stop: StopRequest | None = None, cohort: Cohort | None = None, replanned: Replanned | None = None):
        self.cfg, self.runner, self.rank = cfg, runner, rank
        self.replanned = replanned  # the layout was re-planned for this world: its step time is reported
        self.cohort = cohort or MeshCohort(mesh, cfg.train.grad_clip)
        self.stop = stop or StopRequest()  # the launcher's ranks install its signal handlers
        self.stop_signal = 0  # set when every rank has agreed to stop after the current step
        # TESSEL_FAULT's drills on this rank (markers beside the checkpoints: each fires once)
        self.faults = FaultInjector(rank, checkpoint_root(cfg))
        sampler, self.val_sampler = self._samplers()
        self.state = self._build_state(run_id, sampler)
        with torch.device("meta"):  # the whole model's count, whatever this rank holds of it
            whole = build_model(cfg.model)
        self.n_params = count_params(whole)
        self.flops_per_token = training_flops_per_token(whole, cfg.model, cfg.train.seq_len)  # its own weights
        per_rank = cfg.logging.peak_flops or device_peak_flops(self.cohort.device, cfg.train.precision)
        self.peak_flops = self.cohort.total(per_rank)  # MFU compares the whole run with the whole machine
        # a resumed run appends to the metrics of the attempt it continues
        resumed = cfg.checkpoint.resume is not None
        self.log = MetricsLog(cfg.logging.out_dir, "tensorboard" in cfg.logging.active_trackers, append=resumed,
                              trackers=open_trackers(cfg, run_id, resumed)) if rank == 0 else None
        self.history: list[dict] = []

    def _samplers(self) -> tuple[BatchSampler, BatchSampler]:
        """This rank's shards of the training and the validation batches."""
        t, vocab = self.cfg.train, self.cfg.model.vocab_size
        tokens = load_tokens(self.cfg.data, vocab, seed=t.seed)
        train, val = self.cohort.shards()
        columns = self.cohort.sequence_columns(t.seq_len)
        return (BatchSampler(tokens.train, t.seq_len, t.global_batch, t.seed, *train, vocab,
                             shares=self.cfg.parallel.dp_shares, columns=columns),
                BatchSampler(tokens.val, t.seq_len, t.global_batch, t.seed + 1, *val, vocab, columns=columns))

    def _build_state(self, run_id: str | None, sampler: BatchSampler) -> TrainState:
        """The optimizer (the runner's own, or AdamW over its parameters), the schedule, the data
        position; run_id: checkpoints carry it, pruning and --resume auto touch only the run's own."""
        optimizer, optimizer_state = build_optimizer_state(self.runner, self.cfg.train)
        return TrainState(run_id, self.runner, optimizer, build_scheduler(optimizer, self.cfg.train), sampler,
                          self.cohort.state_tensors(self.runner, optimizer_state))

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.state.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.state.scheduler

    @property
    def sampler(self) -> BatchSampler:
        return self.state.sampler

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        x, y = self.state.sampler.next()
        loss = self.runner.forward_backward(x, y)
        # TESSEL_FAULT=nan: a drill's NaN gradient, after backward and before the update
        if self.faults.poison(optimizer_params(self.state.optimizer)):
            log(f"[tessel fault] injected a NaN gradient on rank {self.rank}")
        done = self.cohort.update(self.state, loss, self.stop.pending())
        self.stop_signal = done.stop_signal
        elapsed = time.perf_counter() - t0
        tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
        row = {"loss": done.loss, "lr": done.lr}
        if done.grad_norm is not None:
            row["grad_norm"] = done.grad_norm
        row.update(speed_fields(elapsed, tokens, self.flops_per_token, self.peak_flops, self.cohort.device))
        if done.skipped is not None:
            row["skipped"] = done.skipped
        row.update(self.runner.extra_metrics())  # layout-specific numbers (MoE load, bubble, staleness)
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = [self.runner.evaluate(*self.val_sampler.batch_at(i)) for i in range(self.cfg.train.eval_batches)]
        return self.cohort.eval_mean(torch.stack(losses).mean()).item()

    def sample(self) -> str:
        return sample_text(self.runner, self.cfg)

    def fit(self) -> Summary:
        t, state = self.cfg.train, self.state
        progress = Progress(t.steps, enabled=self.rank == 0 and self.cfg.logging.progress)
        val_loss = None
        # resumes from a checkpoint when asked (state.step); checkpoints, heartbeat, rollback
        guard = Guard(self.cfg, state, self.cohort, self.faults, self.replanned)
        with progress:
            while state.step < t.steps and not self.stop_signal:
                step = state.step
                guard.begin_step(step)
                row = self.train_step(step)
                state.step = guard.end_step(step, row)  # the next step; earlier after a rollback
                last = step + 1 == t.steps
                if t.eval_every and ((step + 1) % t.eval_every == 0 or last) and not self.stop_signal:
                    val_loss = row["val_loss"] = self.evaluate()
                self.history.append(row)
                if self.log is not None and (step % self.cfg.logging.log_every == 0 or last or self.stop_signal
                                             or guard.relayout is not None):
                    self.log.log(step, row)
                progress.update(step, row)
                if guard.relayout is not None:  # a slow rank: the run goes on in another layout (tessel.adaptive)
                    guard.close()
                    if self.log is not None:
                        self.log.close()
                    raise guard.relayout
        if self.stop_signal:
            guard.preempt(state.step)  # a preemption checkpoint (when checkpoints are on)
            if self.log is not None:
                self.log.close()
            raise Stopped(self.stop_signal, state.step)
        guard.close()
        return self._summary(val_loss)

    def _summary(self, val_loss: float | None) -> Summary:
        if not self.history:  # resumed at train.steps: nothing ran, the metrics file tells the run
            if self.log is not None:
                self.log.close({})  # finished, nothing new for the trackers
            return summary_from_metrics(self.cfg)
        # collective: every rank hands in its events
        files = dict(self.runner.write_timeline(self.cfg.logging.out_dir))
        if self.log is not None:
            for_trackers = tracker_summary(summarize(self.history, val_loss, self.n_params, "", {}))
            files.update(close_log(self.log, "tensorboard" in self.cfg.logging.active_trackers, for_trackers))
        return summarize(self.history, val_loss, self.n_params, self.sample(), files)


def build_optimizer_state(runner: Runner, t: TrainConfig) -> tuple[torch.optim.Optimizer, OptimizerState]:
    """The optimizer the trainer steps, and how a checkpoint holds its state: a strategy's own (ZeRO's
    steps only this rank's shard and checkpoints it itself), or AdamW over the runner's parameters,
    whose state follows them."""
    if runner.optimizer is not None:
        return runner.optimizer, OwnState(runner.optimizer)
    optimizer = build_optimizer(runner.parameters(), t)
    return optimizer, PerParameterState(optimizer)


def summary_from_metrics(cfg: Config) -> Summary:
    """The Summary of a finished run from its metrics.jsonl (empty where there is none)."""
    from tessel.observe.plots import read_metrics  # deferred: loads matplotlib, which this never draws with
    path = Path(cfg.logging.out_dir) / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    last = {}
    for row in rows:  # a resumed run re-logs the steps it replays: the last row of a step counts
        last[row["step"]] = row
    history = [last[s] for s in sorted(last)]
    with torch.device("meta"):
        n_params = count_params(build_model(cfg.model))
    if not history:
        return Summary(steps=0, losses=[], val_loss=None, tokens_per_s=0.0, mfu=0.0, peak_mem_mb=0.0,
                       params=n_params, files={})
    val = [r["val_loss"] for r in history if "val_loss" in r]
    return summarize(history, val[-1] if val else None, n_params, "", {"metrics": str(path)})
