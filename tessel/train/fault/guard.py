"""The trainer's fault hooks: resume, periodic checkpoints, rollback, heartbeat, stragglers, injected delays.

The trainer hands the guard its state and its cohort, and calls three methods,
so its loop stays readable:

    guard = Guard(cfg, state, cohort, injector)  # resumes when asked (state.step); starts the heartbeat
    while state.step < steps:
        guard.begin_step(state.step)
        row = trainer.train_step(state.step)  # skips the update on a non-finite loss/gradient
        state.step = guard.end_step(state.step, row)  # checkpoint, or rollback (returns the next step)
    guard.close()

It reads and restores only the TrainState (tessel.train.state) and gets its
checkpoint writer, heartbeat and straggler check from the cohort
(tessel.train.cohort); it never looks into the trainer. It watches the
runner's compute through forward hooks on Runner.timed_modules (heartbeat
phases, forward times, the `slow` fault); the `nan` fault is the trainer's
own call (FaultInjector.poison, after backward).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from tessel.config import Config
from tessel.heartbeat import log
from tessel.train.checkpoint.manager import run_model
from tessel.train.cohort import Cohort
from tessel.train.fault.elastic import Replanned
from tessel.train.fault.injection import FaultInjector
from tessel.train.fault.stragglers import ForwardTimer, straggler_report
from tessel.train.state import TrainState


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


class Guard:
    def __init__(self, cfg: Config, state: TrainState, cohort: Cohort, injector: FaultInjector,
                 replanned: Replanned | None = None):
        self.cfg, self.state, self.cohort, self.injector = cfg, state, cohort, injector
        self.replanned = replanned  # a re-planned layout: rank 0 reports its measured step time
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # the run id: pruning and --resume auto touch only this run's checkpoints
        self.ckpt = cohort.checkpoints(checkpoint_root(cfg), cfg, state.run_id)
        self.heartbeat = cohort.heartbeat(self.rank, cfg.fault)
        self.timer = self._watch_compute()
        self.bad_in_row, self.rollbacks = 0, 0
        self.saved_step: int | None = None  # the step of this run's newest checkpoint
        c = cfg.checkpoint
        if c.resume:
            found = self.ckpt.find(c.resume, model=run_model(cfg))  # auto skips other models' checkpoints
            if found is None:
                self._say("[tessel checkpoint] no valid checkpoint to resume from: starting at step 0")
            else:
                self.restore(*found)

    def _say(self, msg: str) -> None:
        if self.rank == 0:
            log(msg)

    def _watch_compute(self) -> ForwardTimer:
        """Forward timing (stragglers), heartbeat phases and injected delays, by hooks on the runner's
        timed modules."""
        modules = self.state.runner.timed_modules()
        timer = ForwardTimer(modules, self.cohort.device)  # its hooks first: an injected delay counts
        for module in modules:
            module.register_forward_pre_hook(self._pre_forward)
            module.register_forward_hook(lambda *_: self.heartbeat.set(self.heartbeat.step, "backward"))
        return timer

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
        if self.replanned is not None and self.rank == 0:
            self.replanned.observe(step, row)
        f = self.cfg.fault
        if f.straggler_every and step % f.straggler_every == 0:
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
        times = self.cohort.forward_times(self.timer.take())
        if times is None:  # this cohort's ranks are not compared
            return
        rep = straggler_report(times, f.straggler_factor, f.straggler_min_s)
        row.update(rep)
        if rep["straggler_rank"] >= 0:
            self._say(f"[tessel straggler] step {step}: rank {rep['straggler_rank']} is a straggler: forward "
                      f"{rep['rank_time_max_s']:.3f}s vs median {rep['rank_time_median_s']:.3f}s "
                      f"({rep['straggler_ratio']:.1f}x)")

    # ---- checkpoints ----------------------------------------------------------------
    def save(self, step: int) -> None:
        """`step` is the next step to run: the state after steps 0..step-1."""
        self.saved_step = step
        self.heartbeat.set(step, "checkpoint")
        self.ckpt.save(step, self.state.tensors, self.state.manifest_info(self.cfg, self.world))

    def restore(self, path: Path, manifest: dict) -> int:
        """The state of the checkpoint at `path`; the step to run next (also state.step)."""
        if manifest["global_batch"] != self.cfg.train.global_batch:
            self._say(f"[tessel checkpoint] warning: global batch {self.cfg.train.global_batch} differs from the "
                      f"checkpoint's {manifest['global_batch']}: the trajectory will differ")
        self.ckpt.load(path, self.state.tensors)
        self.state.restore(manifest)
        old = manifest["layout"]
        self._say(f"[tessel checkpoint] resumed from {path} at step {manifest['step']} (saved by "
                  f"{manifest['world_size']} ranks, dp={old['dp']} tp={old['tp']} pp={old['pp']} "
                  f"grad_accum={old['grad_accum']}; now {self.world} ranks)")
        return self.state.step

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
        self.state.optimizer.zero_grad(set_to_none=False)
        return self.restore(*found)

    def preempt(self, step: int) -> None:
        """The run was told to stop before `step`: save the state it reached, when checkpoints are on
        (and the state is not suspect), then close."""
        if self.cfg.checkpoint.every and self.bad_in_row == 0 and self.saved_step != step:
            self._say(f"[tessel checkpoint] preemption checkpoint at step {step}")
            self.save(step)
        self.close()

    def close(self) -> None:
        if self.replanned is not None and self.rank == 0:
            self.replanned.finish()
        self.ckpt.wait()
        self.heartbeat.stop()
