"""The training loop that every rank runs, whatever the layout: data -> runner -> update -> metrics.

The runner (tessel.parallel.runner.Runner) computes; the cohort
(tessel.train.cohort) says how this rank's peers share the data and agree and
how the update is applied (this rank's optimizer over a mesh, or a parameter
server's); the guard (tessel.train.fault.guard) checkpoints, watches and
recovers the TrainState (tessel.train.state) the trainer hands it. Parameter-
server workers run this same loop (tessel.train.ps.trainer).

On a GPU the loop never waits for the device in a steady step: a step's loss,
gradient norm and agreed flags are read once the next step is queued
(tessel.train.overlap), so the metrics row, the progress bar and the guard's
bookkeeping of step N happen at step N+1. A step whose numbers the next step
depends on is read at once: the last, one before a validation or a checkpoint,
one the guard acts on (a rollback a skip could trigger, the ranks' timings:
Guard.acts_after). A stop signal, agreed in every step's all-reduce, is thus
seen one step later: every rank stops after the same step, one further on.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tessel.config import Config, TrainConfig
from tessel.heartbeat import log
from tessel.mesh import Mesh
from tessel.models.build import build_model
from tessel.models.flops import training_flops_per_token
from tessel.models.gpt import count_params
from tessel.observe.attention import check_attention
from tessel.observe.metrics import MetricsLog, device_peak_flops, peak_memory_mb
from tessel.observe.progress import Progress
from tessel.observe.trackers import open_trackers
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.optimizer_state import OptimizerState, OwnState, PerParameterState
from tessel.train.cohort import Cohort, PendingOutcome
from tessel.train.data import BatchSampler, load_tokens, text_codec
from tessel.train.fault.guard import Guard, LayoutReport, checkpoint_root
from tessel.train.fault.injection import FaultInjector
from tessel.train.fault.preempt import Stopped, StopRequest
from tessel.train.mesh_cohort import MeshCohort
from tessel.train.optim import build_optimizer, build_scheduler, optimizer_params
from tessel.train.overlap import StepClock, to_device
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


def close_log(log: MetricsLog, tensorboard: bool = True, summary: dict | None = None,
              plots: bool = True) -> dict[str, str]:
    """Close rank 0's metrics log (its trackers get `summary`) and, with `plots`, plot its curves; the files the
    run wrote."""
    log.close(summary)
    files = {"metrics": str(log.path)}
    if tensorboard:
        files["tensorboard"] = str(Path(log.dir) / "tensorboard")
    if plots:
        from tessel.observe.plots import plot_metrics  # deferred: matplotlib, for the run's last moment
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


@dataclass
class Launched:
    """A step whose work is queued: its outcome on the way to the host, its clock, the runner's numbers."""
    step: int
    outcome: PendingOutcome
    clock: StepClock
    extra: dict


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
                 stop: StopRequest | None = None, cohort: Cohort | None = None, replanned: LayoutReport | None = None):
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
        if rank == 0:  # on a GPU: one line if attention falls back to the math kernel (nothing on the CPU)
            check_attention(cfg, self.cohort.device)
        # a resumed run appends to the metrics of the attempt it continues
        resumed = cfg.checkpoint.resume is not None
        self.log = MetricsLog(cfg.logging.out_dir, "tensorboard" in cfg.logging.active_trackers, append=resumed,
                              trackers=open_trackers(cfg, run_id, resumed)) if rank == 0 else None
        self.history: list[dict] = []
        self.val_loss: float | None = None  # the last validation loss of fit
        # read a step's numbers once the next is queued (fit): on a GPU, so that the host never waits for the
        # device; on the CPU nothing runs ahead of the host (tests set it, to run the GPU's order there)
        self.read_late = self.cohort.device.type == "cuda"

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
        """One step, its metrics row read at once."""
        return self.read_row(self.launch_step(step))

    def launch_step(self, step: int) -> Launched:
        """Queue one step's work: the batch, forward and backward, the agreed update (on a GPU nothing here
        waits for the device: tessel.train.overlap)."""
        clock = StepClock(self.cohort.device)
        x, y = (to_device(t, self.cohort.device) for t in self.state.sampler.next())
        loss = self.runner.forward_backward(x, y)
        # TESSEL_FAULT=nan: a drill's NaN gradient, after backward and before the update
        if self.faults.poison(optimizer_params(self.state.optimizer)):
            log(f"[tessel fault] injected a NaN gradient on rank {self.rank}")
        outcome = self.cohort.update(self.state, loss, self.stop.pending())
        clock.stop()
        # layout-specific numbers (MoE load, bubble, staleness); collective, so every rank calls it here
        return Launched(step, outcome, clock, self.runner.extra_metrics())

    def read_row(self, launched: Launched) -> dict:
        """A launched step's metrics row, its numbers read on the host (on a GPU, waits for them)."""
        done = launched.outcome.read()
        self.stop_signal = self.stop_signal or done.stop_signal  # agreed: once set, every rank stops
        tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
        row = {"loss": done.loss, "lr": done.lr}
        if done.grad_norm is not None:
            row["grad_norm"] = done.grad_norm
        row.update(speed_fields(launched.clock.seconds(), tokens, self.flops_per_token, self.peak_flops,
                                self.cohort.device))
        if done.skipped is not None:
            row["skipped"] = done.skipped
        row.update(launched.extra)
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
        self.val_loss = None
        # resumes from a checkpoint when asked (state.step); checkpoints, heartbeat, rollback
        guard = Guard(self.cfg, state, self.cohort, self.faults, self.replanned)
        pending: Launched | None = None  # a step queued whose numbers are not read yet
        with progress:
            while state.step < t.steps and not self.stop_signal:
                step = state.step
                guard.begin_step(step)
                launched = self.launch_step(step)
                if pending is not None:  # the step before, read now that this one is queued
                    self._conclude(pending, guard, progress, in_flight=step)  # step - 1 + 1 (_reads_late)
                if self._reads_late(step, guard):
                    pending, state.step = launched, step + 1
                else:
                    pending, state.step = None, self._conclude(launched, guard, progress)
            if pending is not None:  # a stop signal, which the step after it brought
                self._conclude(pending, guard, progress)
        if self.stop_signal:
            guard.preempt(state.step)  # a preemption checkpoint (when checkpoints are on)
            if self.log is not None:
                self.log.close()
            raise Stopped(self.stop_signal, state.step)
        guard.close()
        return self._summary(self.val_loss)

    def _reads_late(self, step: int, guard: Guard) -> bool:
        """Whether `step`'s numbers may wait until the next step is queued: not where what follows depends on
        them (the run's last step, a validation or a checkpoint after it, a decision of the guard's)."""
        t, every = self.cfg.train, self.cfg.checkpoint.every
        evaluates = t.eval_every and (step + 1) % t.eval_every == 0
        saves = every and (step + 1) % every == 0
        return self.read_late and step + 1 < t.steps and not (evaluates or saves or guard.acts_after(step))

    def _conclude(self, launched: Launched, guard: Guard, progress: Progress, in_flight: int | None = None) -> int:
        """A launched step's end: its row read, the guard's bookkeeping (checkpoint, rollback), validation, the
        metrics log and the bar; returns the next step to run. in_flight: the step queued after it, if any."""
        t, step = self.cfg.train, launched.step
        row = self.read_row(launched)
        nxt = guard.end_step(step, row, in_flight)  # step + 1; earlier after a rollback
        last = step + 1 == t.steps
        if t.eval_every and ((step + 1) % t.eval_every == 0 or last) and not self.stop_signal:
            self.val_loss = row["val_loss"] = self.evaluate()
        self.history.append(row)
        if self.log is not None and (step % self.cfg.logging.log_every == 0 or last or self.stop_signal
                                     or guard.relayout is not None):
            self.log.log(step, row)
        progress.update(step, row)
        if guard.relayout is not None:  # a slow rank: the run goes on in another layout (tessel.elastic.adaptive)
            guard.close()
            if self.log is not None:
                self.log.close()
            raise guard.relayout
        return nxt

    def _summary(self, val_loss: float | None) -> Summary:
        if not self.history:  # resumed at train.steps: nothing ran, the metrics file tells the run
            if self.log is not None:
                self.log.close({})  # finished, nothing new for the trackers
            return summary_from_metrics(self.cfg)
        plots = self.cfg.logging.plots
        # collective: every rank hands in its events (every rank reads the same logging.plots)
        files = dict(self.runner.write_timeline(self.cfg.logging.out_dir)) if plots else {}
        if self.log is not None:
            for_trackers = tracker_summary(summarize(self.history, val_loss, self.n_params, "", {}))
            files.update(close_log(self.log, "tensorboard" in self.cfg.logging.active_trackers, for_trackers, plots))
        return summarize(self.history, val_loss, self.n_params, self.sample(), files)


def build_optimizer_state(runner: Runner, t: TrainConfig) -> tuple[torch.optim.Optimizer, OptimizerState]:
    """The optimizer the trainer steps, and how a checkpoint holds its state: a strategy's own (ZeRO's
    steps only this rank's shard and checkpoints it itself), or AdamW over the runner's parameters,
    whose state follows them."""
    if runner.optimizer is not None:
        optimizer, state = runner.optimizer, OwnState(runner.optimizer)
    else:
        optimizer = build_optimizer(runner.parameters(), t)
        state = PerParameterState(optimizer)
    for hook in runner.after_update:  # MoE bias balancing: after every update the optimizer takes
        optimizer.register_step_post_hook(lambda *_, hook=hook: hook())
    return optimizer, state


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
