"""`tessel train` with parallel.dp_arch = "ps": dp workers and ps_servers parameter servers.

Ranks 0 .. dp-1 are workers. Each holds the whole model, takes its shard of
every global batch (the same shards as all-reduce DP), runs forward and
backward through the same LocalRunner (grad_accum chunks, precision), pushes
its gradients and loads the weights the servers answer with
(tessel.parallel.ps.parameter_server). Ranks dp .. dp+ps_servers-1 are servers: they own key
ranges of the parameters and apply the trainer's optimizer there: AdamW
without decay on vectors, warm-up then cosine learning rate, gradient
clipping. Under BSP that is the arithmetic of all-reduce DP; ASP and SSP let
workers run ahead (SSP by at most parallel.ps_staleness steps).

There is no device mesh: the servers are ranks outside the dp layout, and
workers talk to servers only. The logged loss is the mean over workers under
BSP (they move in lockstep anyway) and worker 0's own under ASP and SSP
(averaging would make them wait for each other). Validation and sampling run
on worker 0's copy of the weights.

Checkpoints (checkpoint.every, checkpoint.resume) are written by worker 0
from a snapshot of the servers, in the all-reduce trainer's format
(tessel.train.ps_checkpoint). Workers beat every fault.heartbeat_s; servers
drop a worker whose beat stops for fault.hang_timeout_s and go on
(tessel.parallel.ps.parameter_server).
"""

from __future__ import annotations

import logging
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.config import Config, TrainConfig
from tessel.models.gpt import GPT, count_params, cross_entropy, flops_per_token
from tessel.models.moe import with_aux_losses
from tessel.observe.metrics import MetricsLog, device_peak_flops
from tessel.observe.progress import Progress
from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.parallel.runner import LocalRunner
from tessel.train import ps_checkpoint
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.optim import build_optimizer, lr_at
from tessel.train.trainer import Summary, close_log, sample_text, speed_fields, summarize, summary_from_metrics

log = logging.getLogger("tessel.ps")


def server_optimizer(pieces: list[nn.Parameter], t: TrainConfig) -> torch.optim.Optimizer:
    """The trainer's AdamW on a server's (flat) pieces: decay by the dimension of the parameter
    each piece was cut from, so vectors get none."""
    return build_optimizer(pieces, t, decay=lambda q: q.ps_source_dim >= 2)


def roles(cfg: Config) -> tuple[list[int], list[int]]:
    """(workers, servers): workers first, so rank 0 (which reports) is a worker."""
    p = cfg.parallel
    return list(range(p.dp)), list(range(p.dp, p.dp + p.ps_servers))


def train_rank_ps(cfg: Config, device: torch.device, run_id: str | None = None) -> Summary | None:
    """One rank of a parameter-server run; a worker returns its Summary, a server None."""
    p, t = cfg.parallel, cfg.train
    workers, servers = roles(cfg)
    torch.manual_seed(t.seed)  # the same initial weights everywhere (the servers' copy is broadcast too)
    model = GPT(cfg.model).to(device)
    worker_group = dist.new_group(workers)  # collective: every rank makes it
    ps = ParameterServer(model, servers, workers, p.ps_mode, p.ps_staleness,
                         optimizer=lambda pieces: server_optimizer(pieces, t), grad_clip=t.grad_clip,
                         lr_at=lambda step: lr_at(step, t), state_keys=ps_checkpoint.STATE_KEYS,
                         hang_timeout_s=cfg.fault.hang_timeout_s if cfg.fault.heartbeat_s > 0 else 0.0,
                         heartbeat_s=cfg.fault.heartbeat_s)
    found = ps_checkpoint.find(cfg, log=print if dist.get_rank() == 0 else (lambda msg: None), run_id=run_id)
    start = ps_checkpoint.restore(cfg, ps, model, *found) if found is not None else 0
    if found is not None and dist.get_rank() == 0:
        print(f"[tessel checkpoint] resumed from {found[0]} at step {start}", flush=True)
    if ps.is_server:
        stats = ps.serve()
        log.info("ps server %d: %d updates, pushes %s, dead %s, max staleness %d", stats.rank, stats.updates,
                 stats.pushes, stats.dead, stats.max_staleness)
        return None
    return _Worker(cfg, model, ps, worker_group, device, run_id).fit(start)


class _Worker:
    def __init__(self, cfg: Config, model: GPT, ps: ParameterServer, group, device: torch.device,
                 run_id: str | None = None):
        self.cfg, self.ps, self.group, self.device = cfg, ps, group, device
        t, p = cfg.train, cfg.parallel
        self.rank = dist.get_rank()
        loss_fn = with_aux_losses(cross_entropy, model) if cfg.model.n_experts else cross_entropy
        self.runner = LocalRunner(model, loss_fn, t.grad_accum * p.micro_batches, device, t.precision,
                                  vocab_size=cfg.model.vocab_size, max_seq_len=cfg.model.max_seq_len)
        tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=t.seed)
        self.sampler = BatchSampler(tokens.train, t.seq_len, t.global_batch, t.seed, self.rank, p.dp,
                                    vocab_size=cfg.model.vocab_size)
        # worker 0 validates alone, on the whole global batch (all-reduce DP averages the dp shards' means)
        self.val_sampler = BatchSampler(tokens.val, t.seq_len, t.global_batch, t.seed + 1,
                                        vocab_size=cfg.model.vocab_size)
        self.lead = self.rank == 0
        self.writer = ps_checkpoint.Writer(cfg, ps, self.runner, run_id=run_id) if self.lead else None
        # a resumed run appends to the metrics of the attempt it continues
        self.log = MetricsLog(cfg.logging.out_dir, cfg.logging.tensorboard,
                              append=cfg.checkpoint.resume is not None) if self.lead else None
        with torch.device("meta"):
            self.n_params = count_params(GPT(cfg.model))
        self.flops_per_token = flops_per_token(cfg.model, t.seq_len)
        per_rank = cfg.logging.peak_flops or device_peak_flops(device, t.precision)
        self.peak_flops = per_rank * p.dp  # the servers do no model flops
        self.history: list[dict] = []

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        x, y = self.sampler.next()
        self.ps.begin_step()
        loss = self.runner.forward_backward(x, y).float()
        self.ps.push()  # the servers' answer: the weights for the next step
        if self.cfg.parallel.ps_mode == "bsp" and self.group is not None and self.cfg.parallel.dp > 1:
            dist.all_reduce(loss, group=self.group)
            loss = loss / self.cfg.parallel.dp
        elapsed = time.perf_counter() - t0
        tokens = self.cfg.train.global_batch * self.cfg.train.seq_len
        return {"loss": loss.item(), "lr": lr_at(step, self.cfg.train),
                **speed_fields(elapsed, tokens, self.flops_per_token, self.peak_flops, self.device),
                "staleness": self.ps.observed_staleness()}

    def fit(self, start: int = 0) -> Summary:
        t, every = self.cfg.train, self.cfg.checkpoint.every
        self.sampler.load_state_dict({**self.sampler.state_dict(), "step": start})
        progress = Progress(t.steps, enabled=self.lead and self.cfg.logging.progress)
        val_loss = None
        with progress:
            for step in range(start, t.steps):
                row = self.step(step)
                if self.writer is not None and every and (step + 1) % every == 0:
                    self.writer.save(step + 1, self.sampler.state_dict())
                if self.lead and t.eval_every and ((step + 1) % t.eval_every == 0 or step + 1 == t.steps):
                    val_loss = row["val_loss"] = self.evaluate()  # worker 0's weights, no collective
                self.history.append(row)
                if self.log is not None and (step % self.cfg.logging.log_every == 0 or step + 1 == t.steps):
                    self.log.log(step, row)
                progress.update(step, row)
        if self.writer is not None:
            self.writer.wait()  # the last checkpoint is committed before this worker says it is done
        self.ps.finish()
        return self.summary(val_loss)

    @torch.no_grad()
    def evaluate(self) -> float:
        losses = [self.runner.evaluate(*self.val_sampler.batch_at(i)) for i in range(self.cfg.train.eval_batches)]
        return torch.stack(losses).mean().item()

    def summary(self, val_loss: float | None) -> Summary:
        if not self.history:  # resumed at train.steps: nothing ran, the metrics file tells the run
            if self.log is not None:
                self.log.close()
            return summary_from_metrics(self.cfg)
        files, sample = {}, ""
        if self.log is not None:
            files = close_log(self.log, tensorboard=self.cfg.logging.tensorboard)
            sample = sample_text(self.runner, self.cfg)  # worker 0's weights, no collective
        return summarize(self.history, val_loss, self.n_params, sample, files)
