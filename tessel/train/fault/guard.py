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
from typing import Protocol

import torch
import torch.distributed as dist

from tessel.config import Config
from tessel.heartbeat import log
from tessel.models.emulated import DeviceTime
from tessel.planner.hetero import rebalanced
from tessel.train.checkpoint.manager import run_model, step_dir
from tessel.train.cohort import Cohort
from tessel.train.fault.injection import FaultInjector
from tessel.train.fault.slow import Relayout, SlowRank, SlowRanks, evicted_with
from tessel.train.fault.stragglers import ForwardTimer, straggler_report
from tessel.train.state import TrainState


class LayoutReport(Protocol):
    """What the guard tells a re-planned layout's report (tessel.elastic.dp_only.Replanned): each metrics
    row, then the run's end. A protocol, so that the trainer does not import re-planning."""

    def observe(self, step: int, row: dict) -> None: ...

    def finish(self) -> None: ...


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


class Guard:
    def __init__(self, cfg: Config, state: TrainState, cohort: Cohort, injector: FaultInjector,
                 replanned: LayoutReport | None = None):
        self.cfg, self.state, self.cohort, self.injector = cfg, state, cohort, injector
        self.replanned = replanned  # a re-planned layout: rank 0 reports its measured step time
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # the run id: pruning and --resume auto touch only this run's checkpoints
        self.ckpt = cohort.checkpoints(checkpoint_root(cfg), cfg, state.run_id)
        self.heartbeat = cohort.heartbeat(self.rank, cfg.fault)
        self.timer = self._watch_compute()
        self.bad_in_row, self.rollbacks = 0, 0
        self.slow = SlowRanks(cfg.fault)  # fault.slow_policy's evidence
        self.relayout: Relayout | None = None  # what a slow-rank policy decided, raised by the trainer
        self._t_forward = 0.0
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
        for module in modules:  # a device slowed by a factor: around the timer's hooks, so that it counts
            module.register_forward_pre_hook(self._slow_start)
            module.register_forward_hook(self._slow_end)
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

    def _slow_start(self, *_):
        self._t_forward = time.perf_counter()

    def _slow_end(self, module, args, out):
        """TESSEL_FAULT slow:...:factor=F: this forward takes F times as long, and its backward too
        (the output's backward waits (F-1) x twice the forward: tessel.models.emulated.DeviceTime)."""
        factor = self.injector.slow_factor(self.heartbeat.step)
        if factor == 1.0 or not torch.is_grad_enabled() or not isinstance(out, torch.Tensor):
            return out
        extra = (factor - 1) * (time.perf_counter() - self._t_forward)
        return DeviceTime.apply(out, extra, 2 * extra)

    # ---- per step -----------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        self.heartbeat.set(step, "data", flush=True)
        self.injector.before_step(step)

    def acts_after(self, step: int) -> bool:
        """Whether end_step(step) may do more than book-keep, so that its row must be read before the next step
        is queued (tessel.train.trainer): compare the ranks' timings (a collective; under a slow-rank policy
        every step, which may end the step in a re-layout), or roll back (this step's skip would be the
        nan_tolerance-th in a row)."""
        every = self._watch_every()
        return bool(every and step % every == 0) or self.bad_in_row + 1 >= self.cfg.fault.nan_tolerance

    def _watch_every(self) -> int:
        """Steps between two comparisons of the ranks' timings (0: never); every step under a slow-rank policy,
        whose action needs each step's evidence."""
        f = self.cfg.fault
        return 1 if f.slow_policy != "warn" else f.straggler_every

    def end_step(self, step: int, row: dict, in_flight: int | None = None) -> int:
        """After a step's row is read; the next step to run. in_flight: the step already queued after it (its
        row read late, tessel.train.trainer), which the heartbeat keeps naming."""
        self.heartbeat.set(step if in_flight is None else in_flight, "step-end")
        self.ckpt.poll()
        if self.replanned is not None and self.rank == 0:
            self.replanned.observe(step, row)
        f = self.cfg.fault
        every = self._watch_every()
        if every and step % every == 0:
            self._watch_ranks(step, row, every)
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
        if self.relayout is not None:  # a slow rank's policy: continue from this state in another layout
            if self.saved_step != nxt:
                self.save(nxt)
            self.ckpt.wait()
            self.relayout.checkpoint = str(step_dir(checkpoint_root(self.cfg), nxt))
        return nxt

    def _watch_ranks(self, step: int, row: dict, steps: int) -> None:
        """Every rank's forward time since the last look: straggler warnings, the slow-rank policy."""
        f = self.cfg.fault
        times = self.cohort.forward_times(self.timer.take())
        if times is None:  # this cohort's ranks are not compared
            return
        if f.straggler_every and step % f.straggler_every == 0:
            self._stragglers(step, row, times)
        found = self.slow.observe(step, [t / steps for t in times], row.get("step_time_s", 0.0))
        if found is not None:
            row.update(slow_rank=found.rank, slow_ratio=found.ratio)
            self._act_on(found)

    def _stragglers(self, step: int, row: dict, times: list[float]) -> None:
        f = self.cfg.fault
        rep = straggler_report(times, f.straggler_factor, f.straggler_min_s)
        row.update(rep)
        if rep["straggler_rank"] >= 0:
            self._say(f"[tessel straggler] step {step}: rank {rep['straggler_rank']} is a straggler: forward "
                      f"{rep['rank_time_max_s']:.3f}s vs median {rep['rank_time_median_s']:.3f}s "
                      f"({rep['straggler_ratio']:.1f}x)")

    def _act_on(self, found: SlowRank) -> None:
        """fault.slow_policy on a persistently slow rank: log the evidence and the decision; rebalance and
        evict end the step with a checkpoint and a Relayout the trainer raises."""
        policy = self.cfg.fault.slow_policy
        self._say(found.line())
        if policy == "rebalance":
            new, what = rebalanced(self.cfg, found.forward_s)
            if new is not None:
                self.relayout = Relayout(new, "", [], f"rebalance: {what}")
            self._say(f"[tessel slow] policy rebalance: {what}" + ("" if new is not None else "; nothing to do"))
        elif policy == "evict" and self.world > 1:
            leave, which = evicted_with(self.cfg, self.world, found.rank)
            self.relayout = Relayout(self.cfg, "", leave, f"evict {which}")
            self._say(f"[tessel slow] policy evict: {which} leave; checkpoint, then continue on "
                      f"{self.world - len(leave)} ranks, re-planned (fault.replan = '{self.cfg.fault.replan}')")
        else:
            self._say(f"[tessel slow] policy {policy}: no action")

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
