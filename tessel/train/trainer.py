"""The training loop that every rank runs: data -> runner -> optimizer -> metrics."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.config import Config
from tessel.mesh import Mesh
from tessel.models.gpt import GPT, count_params, flops_per_token
from tessel.observe.metrics import MetricsLog, device_peak_flops, peak_memory_mb
from tessel.observe.progress import Progress
from tessel.parallel.norms import clip_grad_norm_
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.fault.guard import Guard
from tessel.train.fault.numerics import agree
from tessel.train.fault.preempt import Stopped, StopRequest
from tessel.train.optim import build_optimizer, build_scheduler, optimizer_params


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
    """train.sample_tokens bytes generated from train.sample_prompt ("" when 0); collective over the runner."""
    t = cfg.train
    if t.sample_tokens == 0:
        return ""
    prompt = torch.tensor([list(t.sample_prompt.encode())], dtype=torch.long) % cfg.model.vocab_size
    out = runner.generate(prompt, t.sample_tokens, seed=t.seed)
    return bytes(int(v) % 256 for v in out[0].tolist()).decode("utf-8", errors="replace")


def speed_fields(elapsed: float, tokens: int, flops_per_token: float, peak_flops: float,
                 device: torch.device) -> dict[str, float]:
    """A step's throughput fields of the metrics row: time, tokens/s, MFU, peak memory."""
    return {"step_time_s": elapsed, "tokens_per_s": tokens / elapsed,
            "mfu": flops_per_token * tokens / elapsed / peak_flops, "peak_mem_mb": peak_memory_mb(device)}


def close_log(log: MetricsLog, tensorboard: bool = True) -> dict[str, str]:
    """Close rank 0's metrics log and plot its curves; the files the run wrote there."""
    from tessel.observe.plots import plot_metrics
    log.close()
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


def mean_over(value: torch.Tensor, mesh: Mesh, *axes: str) -> torch.Tensor:
    group = mesh.group(*axes)
    if group is not None:
        dist.all_reduce(value, group=group)
        value = value / mesh.size(*axes)
    return value


class Trainer:
    def __init__(self, cfg: Config, mesh: Mesh, model: GPT, runner, rank: int = 0, run_id: str | None = None,
                 stop: StopRequest | None = None):
        self.cfg, self.mesh, self.runner, self.rank = cfg, mesh, runner, rank
        self.run_id = run_id  # checkpoints carry it; pruning and --resume auto touch only the run's own
        self.stop = stop or StopRequest()  # the launcher's ranks install its signal handlers
        self.stop_signal = 0  # set when every rank has agreed to stop after the current step
        t = cfg.train
        # a runner may bring its own optimizer (ZeRO's steps only this rank's shard);
        # the gradient norm is over what the optimizer steps (sharded grads are marked)
        self.optimizer = getattr(runner, "optimizer", None)
        if self.optimizer is None:
            self.optimizer = build_optimizer(runner.parameters(), t)
        self.params = optimizer_params(self.optimizer)
        self.scheduler = build_scheduler(self.optimizer, t)
        tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=t.seed)
        shard, shards = mesh.local_rank_in("dp", "ep"), mesh.size("dp", "ep")
        self.sampler = BatchSampler(tokens.train, t.seq_len, t.global_batch, t.seed, shard, shards,
                                    cfg.model.vocab_size)
        self.val_sampler = BatchSampler(tokens.val, t.seq_len, t.global_batch, t.seed + 1, shard, shards,
                                        cfg.model.vocab_size)
        with torch.device("meta"):  # the whole model's count, whatever this rank holds of it
            self.n_params = count_params(GPT(cfg.model))
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        self.peak_flops = self._device_peak_flops()
        # a resumed run appends to the metrics of the attempt it continues
        self.log = MetricsLog(cfg.logging.out_dir, cfg.logging.tensorboard,
                              append=cfg.checkpoint.resume is not None) if rank == 0 else None
        self.history: list[dict] = []

    def _device_peak_flops(self) -> float:
        """Sum of every rank's peak, so MFU compares the whole run with the whole machine."""
        per_rank = self.cfg.logging.peak_flops or device_peak_flops(self.mesh.device, self.cfg.train.precision)
        total = torch.tensor([per_rank], dtype=torch.float64, device=self.mesh.device)
        if dist.is_initialized():
            dist.all_reduce(total)
        return float(total.item())

    def train_step(self, step: int) -> dict:
        t0 = time.perf_counter()
        x, y = self.sampler.next()
        loss = self.runner.forward_backward(x, y)
        loss = mean_over(loss.float(), self.mesh, "dp", "ep")  # also a sync point for timing
        grad_norm = clip_grad_norm_(self.params, self.cfg.train.grad_clip, self.mesh)
        lr = self.optimizer.param_groups[0]["lr"]
        finite, self.stop_signal = agree(loss, grad_norm, self.stop.pending(), self.mesh.device)
        if finite:
            self.optimizer.step()
        self.scheduler.step()
        # set_to_none=False keeps gradients as views of the data-parallel buckets
        self.optimizer.zero_grad(set_to_none=False)
        elapsed = time.perf_counter() - t0
        tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
        row = {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm.item(),
               **speed_fields(elapsed, tokens, self.flops_per_token, self.peak_flops, self.mesh.device),
               "skipped": not finite}
        extra = getattr(self.runner, "extra_metrics", None)  # runners may add layout-specific metrics
        if extra is not None:
            row.update(extra())
        return row

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = [self.runner.evaluate(*self.val_sampler.batch_at(i)) for i in range(self.cfg.train.eval_batches)]
        return mean_over(torch.stack(losses).mean(), self.mesh, "dp", "ep").item()

    def sample(self) -> str:
        return sample_text(self.runner, self.cfg)

    def fit(self) -> Summary:
        t = self.cfg.train
        progress = Progress(t.steps, enabled=self.rank == 0 and self.cfg.logging.progress)
        val_loss = None
        guard = Guard(self)  # resumes from a checkpoint when asked; checkpoints, heartbeat, rollback
        step = guard.start_step
        with progress:
            while step < t.steps and not self.stop_signal:
                guard.begin_step(step)
                row = self.train_step(step)
                next_step = guard.end_step(step, row)  # the next step; earlier after a rollback
                last = step + 1 == t.steps
                if t.eval_every and ((step + 1) % t.eval_every == 0 or last) and not self.stop_signal:
                    val_loss = row["val_loss"] = self.evaluate()
                self.history.append(row)
                if self.log is not None and (step % self.cfg.logging.log_every == 0 or last or self.stop_signal):
                    self.log.log(step, row)
                progress.update(step, row)
                step = next_step
        if self.stop_signal:
            guard.preempt(step)  # a preemption checkpoint (when checkpoints are on)
            if self.log is not None:
                self.log.close()
            raise Stopped(self.stop_signal, step)
        guard.close()
        return self._summary(val_loss)

    def _summary(self, val_loss: float | None) -> Summary:
        if not self.history:  # resumed at train.steps: nothing ran, the metrics file tells the run
            if self.log is not None:
                self.log.close()
            return summary_from_metrics(self.cfg)
        files = {}
        if hasattr(self.runner, "write_timeline"):  # collective: every rank hands in its events
            files.update(self.runner.write_timeline(self.cfg.logging.out_dir))
        if self.log is not None:
            files.update(close_log(self.log))
        return summarize(self.history, val_loss, self.n_params, self.sample(), files)


def summary_from_metrics(cfg: Config) -> Summary:
    """The Summary of a finished run from its metrics.jsonl (empty where there is none)."""
    from tessel.observe.plots import read_metrics
    path = Path(cfg.logging.out_dir) / "metrics.jsonl"
    rows = read_metrics(path) if path.is_file() else []
    last = {}
    for row in rows:  # a resumed run re-logs the steps it replays: the last row of a step counts
        last[row["step"]] = row
    history = [last[s] for s in sorted(last)]
    with torch.device("meta"):
        n_params = count_params(GPT(cfg.model))
    if not history:
        return Summary(steps=0, losses=[], val_loss=None, tokens_per_s=0.0, mfu=0.0, peak_mem_mb=0.0,
                       params=n_params, files={})
    val = [r["val_loss"] for r in history if "val_loss" in r]
    return summarize(history, val[-1] if val else None, n_params, "", {"metrics": str(path)})
