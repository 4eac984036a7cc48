"""The trainer's fault hooks: resume, periodic checkpoints, rollback, heartbeat, stragglers, injection.

The trainer calls three methods, so its loop stays readable:

    guard = Guard(trainer)             # resumes when asked; starts the heartbeat
    step = guard.start_step
    while step < steps:
        guard.begin_step(step)
        row = trainer.train_step(step)  # skips the update on a non-finite loss/gradient
        step = guard.end_step(step, row)  # metrics, checkpoint, or rollback (returns the next step)
    guard.close()
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.heartbeat import Heartbeat, log
from tessel.train.checkpoint.manager import CheckpointManager, run_model
from tessel.train.fault.injection import FaultInjector
from tessel.train.fault.stragglers import ForwardTimer, gather_times, straggler_report


def checkpoint_root(cfg) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


def _plain(obj):
    """JSON-safe copy of a state dict made of numbers, strings, lists and dicts (else TypeError)."""
    return json.loads(json.dumps(obj, default=_refuse))


def run_info(cfg, world_size: int, sampler_state: dict, scheduler_state: dict, param_groups) -> dict:
    """The plain-value training state a checkpoint's manifest holds beside its tensors."""
    return {"world_size": world_size, "model": cfg.model.model_dump(),
            "layout": {**cfg.parallel.model_dump(), "grad_accum": cfg.train.grad_accum},
            "global_batch": cfg.train.global_batch, "sampler": sampler_state, "scheduler": _plain(scheduler_state),
            "param_groups": _plain([{k: v for k, v in g.items() if k != "params"} for g in param_groups])}


def _refuse(o):
    if isinstance(o, tuple):
        return list(o)
    raise TypeError(f"{type(o).__name__} does not belong in a JSON manifest")


class Guard:
    def __init__(self, trainer):
        self.trainer = trainer
        cfg, self.cfg = trainer.cfg, trainer.cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        c, f = cfg.checkpoint, cfg.fault
        # the run id: pruning and --resume auto touch only this run's checkpoints
        self.ckpt = CheckpointManager(checkpoint_root(cfg), trainer.mesh, c.keep, c.async_save,
                                      run_id=trainer.run_id)
        self.injector = FaultInjector(self.rank, checkpoint_root(cfg))
        self.heartbeat = Heartbeat(self.rank, self.world, f.heartbeat_s, f.hang_timeout_s, f.kill_stalled)
        if f.heartbeat_s > 0:
            self.heartbeat.start()
        self._instrument(trainer.runner)
        self.bad_in_row, self.rollbacks, self.start_step = 0, 0, 0
        self.saved_step: int | None = None  # the step of this run's newest checkpoint
        if c.resume:
            found = self.ckpt.find(c.resume, model=run_model(cfg))  # auto skips other models' checkpoints
            if found is None:
                self._say("[tessel checkpoint] no valid checkpoint to resume from: starting at step 0")
            else:
                self.start_step = self.restore(*found)

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            log(msg)

    def _instrument(self, runner) -> None:
        """Forward timing (stragglers), heartbeat phases and injected faults, by hooks and one wrapper."""
        model = getattr(runner, "model", None)
        self.timer = ForwardTimer(model, self.trainer.mesh.device) if model is not None else None
        if model is not None:
            model.register_forward_pre_hook(self._pre_forward)
            model.register_forward_hook(lambda *_: self.heartbeat.set(self.heartbeat.step, "backward"))
        inner = runner.forward_backward

        def forward_backward(x, y):
            loss = inner(x, y)
            if self.injector.poison(self.trainer.params):
                log(f"[tessel fault] injected a NaN gradient on rank {self.rank}")
            return loss
        runner.forward_backward = forward_backward

    def _pre_forward(self, *_):
        self.heartbeat.set(self.heartbeat.step, "forward")
        delay = self.injector.slow_seconds(self.heartbeat.step)
        if delay and torch.is_grad_enabled():
            time.sleep(delay)

    # ---- per step -----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.heartbeat.set(step, "data", flush=True)
        self.injector.before_step(step)

    def end_step(self, step: int, row: dict) -> int:
        self.heartbeat.set(step, "step-end")
        self.ckpt.poll()
        f = self.cfg.fault
        if f.straggler_every and step % f.straggler_every == 0 and self.timer is not None:
            self._stragglers(step, row)
        if row.get("skipped"):
            self.bad_in_row += 1
            self._say(f"[tessel fault] step {step}: non-finite loss or gradient (loss {row['loss']}, "
                      f"grad norm {row['grad_norm']}): update skipped on every rank "
                      f"({self.bad_in_row} in a row, rollback at {f.nan_tolerance})")
            if self.bad_in_row >= f.nan_tolerance:
                target = self.rollback(step)
                row["rolled_back_to"] = target
                return target
        else:
            self.bad_in_row = 0
        nxt = step + 1
        every = self.cfg.checkpoint.every
        if every and nxt % every == 0 and self.bad_in_row == 0:  # never checkpoint a suspect state
            self.save(nxt)
        return nxt

    def _stragglers(self, step: int, row: dict) -> None:
        f = self.cfg.fault
        times = gather_times(self.timer.take(), self.trainer.mesh.device)
        rep = straggler_report(times, f.straggler_factor, f.straggler_min_s)
        row.update(rep)
        if rep["straggler_rank"] >= 0:
            self._say(f"[tessel straggler] step {step}: rank {rep['straggler_rank']} is a straggler: forward "
                      f"{rep['rank_time_max_s']:.3f}s vs median {rep['rank_time_median_s']:.3f}s "
                      f"({rep['straggler_ratio']:.1f}x)")

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, step: int) -> None:
        """`step` is the next step to run: the state after steps 0..step-1."""
        t = self.trainer
        self.saved_step = step
        self.heartbeat.set(step, "checkpoint")
        info = run_info(self.cfg, self.world, t.sampler.state_dict(), t.scheduler.state_dict(),
                        t.optimizer.param_groups)
        self.ckpt.save(step, t.runner, t.optimizer, info)

    def restore(self, path: Path, manifest: dict) -> int:
        t = self.trainer
        if manifest["global_batch"] != self.cfg.train.global_batch:
            self._say(f"[tessel checkpoint] warning: global batch {self.cfg.train.global_batch} differs from the "
                      f"checkpoint's {manifest['global_batch']}: the trajectory will differ")
        self.ckpt.load(path, t.runner, t.optimizer)
        for group, saved in zip(t.optimizer.param_groups, manifest["param_groups"]):
            group.update({k: tuple(v) if k == "betas" else v for k, v in saved.items()})
        t.scheduler.load_state_dict(manifest["scheduler"])
        t.sampler.load_state_dict(manifest["sampler"])
        old = manifest["layout"]
        self._say(f"[tessel checkpoint] resumed from {path} at step {manifest['step']} (saved by "
                  f"{manifest['world_size']} ranks, dp={old['dp']} tp={old['tp']} pp={old['pp']} "
                  f"grad_accum={old['grad_accum']}; now {self.world} ranks)")
        return int(manifest["step"])

    def rollback(self, step: int) -> int:
        f = self.cfg.fault
        self.rollbacks += 1
        if self.rollbacks > f.max_rollbacks:
            raise RuntimeError(f"{f.nan_tolerance} non-finite steps in a row after {f.max_rollbacks} rollbacks: "
                               "giving up (lower the learning rate or inspect the data at these steps)")
        self.ckpt.wait()
        found = self.ckpt.find("auto", model=run_model(self.cfg))
        if found is None:
            raise RuntimeError(f"{f.nan_tolerance} non-finite steps in a row at step {step} and no checkpoint "
                               "to roll back to (set checkpoint.every)")
        self._say(f"[tessel fault] {f.nan_tolerance} non-finite steps in a row (up to step {step}): "
                  f"rolling back to {found[0].name}")
        self.injector.cancel()
        self.bad_in_row = 0
        self.trainer.optimizer.zero_grad(set_to_none=False)
        return self.restore(*found)

    def preempt(self, step: int) -> None:
        """The run was told to stop before `step`: save the state it reached, when checkpoints are on
        (and the state is not suspect), then close."""
        if self.cfg.checkpoint.every and self.bad_in_row == 0 and self.saved_step != step:
            self._say(f"[tessel checkpoint] preemption checkpoint at step {step}")
            self.save(step)
        self.close()

    def close(self) -> None:
        self.ckpt.wait()
        self.heartbeat.stop()
