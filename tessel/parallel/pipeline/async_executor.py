"""The executor of an asynchronous pipeline (PipeDream, PipeDream-2BW): steps that continue each other.

A step runs its lists of async_schedules.py: step k forwards batch k's
micro-batches (mb 0..m-1) while finishing batch k-1's last ones (mb -m..-1).
What a micro-batch holds between its actions (its input and output, its
saved activations, the W its B left) is carried from one step into the next,
renamed mb -> mb - m, with the previous batch's targets for the last stage.
Each micro-batch runs on the weight version weight_versions.py gives it, with
`torch.func.functional_call`, so the parameters themselves are free to change
under it; its weight gradients accumulate in its version's stash.

- 2BW: after the step's last action the previous batch's gradient is complete;
  it goes into the parameters' `.grad` (data parallelism averages it), and the
  trainer's update applies it: one step late, as 2BW's rule says.
- PipeDream: after each W the stage applies that micro-batch's gradient at
  once with its own optimizer (data parallelism averages it first); the
  trainer's update is a no-op (UpdatedInPipeline) whose learning-rate schedule
  the stage's optimizer follows.

The loss a step reports is the mean loss of the micro-batches the last stage
forwarded during the step: from step 1 on, m of them, the last of the previous
batch and the first of this one (at step 0, the ones it reached).
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn
from torch.func import functional_call

from tessel.parallel.pipeline.async_schedules import build_async
from tessel.parallel.pipeline.comm import StageLinks
from tessel.parallel.pipeline.executor import ScheduleExecutor, StepState
from tessel.parallel.pipeline.grad_sync import GradientSync
from tessel.parallel.pipeline.recorder import StepRecorder
from tessel.parallel.pipeline.schedules import Action, Placement
from tessel.parallel.pipeline.spec import PipelineSpec
from tessel.parallel.pipeline.weight_versions import DoubleBuffered, Stash, Stashed

CARRIED = ("chunk_inputs", "outputs", "saved_bytes", "weight_work")  # StepState's per-micro-batch records


class UpdatedInPipeline(torch.optim.Optimizer):
    """The trainer's handle on an optimizer the pipeline steps itself (PipeDream, after every micro-batch).

    Its step and zero_grad do nothing; it shares the inner optimizer's param_groups, so the trainer's
    learning-rate schedule sets the rate the pipeline's updates use."""

    def __init__(self, inner: torch.optim.Optimizer):  # not Optimizer.__init__: the groups are the inner's
        self.inner = inner
        self.defaults, self.state, self.param_groups = inner.defaults, inner.state, inner.param_groups
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}
        self._zero_grad_profile_name = "UpdatedInPipeline.zero_grad"

    def step(self, closure=None):
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None


class AsyncExecutor(ScheduleExecutor):
    """This rank's part of an asynchronous pipeline; one trainer step per `run`, each continuing the last."""

    def __init__(self, chunks: Sequence[nn.Module], placement: Placement, links: StageLinks,
                 recorder: StepRecorder, spec: PipelineSpec, sync: GradientSync,
                 micro_optimizer: torch.optim.Optimizer | None = None, vertical_sync: bool = False):
        self.plan = build_async(placement.p, spec.micro_batches)
        super().__init__(chunks, placement, links, recorder, spec, sync)
        self.pipedream = spec.schedule == "pipedream"
        self.micro_optimizer, self.vertical_sync = micro_optimizer, vertical_sync
        if self.pipedream and micro_optimizer is None:
            raise ValueError("pipedream updates after every micro-batch: it needs the stage's optimizer")
        self.versions = Stashed(self.chunks) if self.pipedream else DoubleBuffered(self.chunks)
        self.step = 0
        self.carry: dict[str, dict] = {name: {} for name in CARRIED}
        self.uses: dict[tuple[int, int], Stash] = {}  # (mb, chunk) -> the version its forward ran on
        self.prev_targets: tuple[torch.Tensor, ...] = ()
        self.forwards = [0] * len(self.chunks)  # forwards run per chunk: the next one's global micro-batch
        self.micro_losses: dict[int, float] = {}  # last stage: this step's loss of each global micro-batch
        self._skip_stashes()

    def step_actions(self, step: int) -> list[Action]:
        return self.plan.lists(step)[self.placement.rank]

    # ---- a step -----------------------------------------------------------------------
    def new_state(self, x: torch.Tensor, y: torch.Tensor) -> StepState:
        state = super().new_state(x, y)
        for name in CARRIED:  # the previous step's micro-batches in flight, renamed mb -> mb - m
            getattr(state, name).update({(mb - self.m, c): v for (mb, c), v in self.carry[name].items()})
        self.uses = {(mb - self.m, c): v for (mb, c), v in self.uses.items()}
        self.recorder.saved.held(sum(state.saved_bytes.values()))
        self.micro_losses = {}
        return state

    def run(self, state: StepState) -> None:
        self._plan(self.step_actions(self.step))
        if not self.pipedream:
            self.versions.start_step(self.step)
        super().run(state)
        if self.micro_losses and len(self.micro_losses) != self.m:  # the first step's last stage ran fewer
            state.loss *= self.m / len(self.micro_losses)
        if not self.pipedream:
            self._apply_finished_batch()
        self.carry = {name: dict(getattr(state, name)) for name in CARRIED}
        self.prev_targets = state.targets
        self.step += 1

    def _apply_finished_batch(self) -> None:
        """2BW: the previous batch's gradient into `.grad` (averaged over dp), for the trainer's update."""
        for c, chunk in enumerate(self.chunks):
            grads = self.versions.finished(c)
            if grads is None:
                continue  # step 0: no batch has finished, and no update is due
            params = [p for p, g in zip(chunk.parameters(), grads) if g is not None]
            self.sync.before_backward(c, chunk_done=True, rank_done=True)
            torch.autograd.backward(params, [g for g in grads if g is not None])  # .grad += g, then dp's hooks

    # ---- compute on a version ---------------------------------------------------------------
    def _run_chunk(self, a: Action, inp: torch.Tensor) -> torch.Tensor:
        g = self.step * self.m + a.mb  # the micro-batch's global index
        stash = self._version_for_forward(a.chunk, g, a.mb)
        self.uses[(a.mb, a.chunk)] = stash
        self.forwards[a.chunk] += 1
        return functional_call(self.chunks[a.chunk], stash.tensors, (inp,))

    def _version_for_forward(self, chunk: int, g: int, mb: int) -> Stash:
        if not self.pipedream:
            return self.versions.for_micro_batch(mb, chunk)
        version = self.plan.rank0_updates_before_forward(g) if self.vertical_sync else self.versions.updates[chunk]
        before = len(self.versions.allocated)
        stash = self.versions.version(chunk, version)
        if len(self.versions.allocated) != before:
            self._skip_stashes()
        return stash

    def _targets(self, state: StepState, mb: int) -> torch.Tensor:
        return state.targets[mb] if mb >= 0 else self.prev_targets[mb]

    def _with_losses(self, a: Action, out: torch.Tensor, state: StepState) -> torch.Tensor:
        out = super()._with_losses(a, out, state)
        if self.placement.is_last(a.chunk):
            self.micro_losses[self.step * self.m + a.mb] = out.item() * self.m
        return out

    def _weights(self, a: Action, state: StepState) -> None:
        """W into the micro-batch's stash; PipeDream then updates the stage with it."""
        key = (a.mb, a.chunk)
        state.weight_work.pop(key).run()
        self.recorder.saved.released(state.saved_bytes.pop(key))
        stash = self.uses.pop(key)
        if self.pipedream:
            self._update(a.chunk, stash)

    def _update(self, c: int, stash: Stash) -> None:
        """PipeDream: this micro-batch's gradient (averaged over dp) applied to the stage now."""
        if self.vertical_sync:  # a later forward may need today's weights: copy them before they change
            if self.plan.rank0_updates_before_forward(self.forwards[c]) <= self.versions.updates[c]:
                self.versions.keep_current(c)
                self._skip_stashes()
        grads = stash.grads()
        params = [p for p, g in zip(self.chunks[c].parameters(), grads) if g is not None]
        self.sync.before_backward(c, chunk_done=True, rank_done=True)
        torch.autograd.backward(params, [g for g in grads if g is not None])  # .grad += g, then dp's hooks
        self.micro_optimizer.step()
        self.micro_optimizer.zero_grad(set_to_none=False)  # set_to_none=False: dp's bucket views stay
        for t in stash.tensors.values():
            t.grad = None
        self.versions.updated(c)
        needed = {s.version for (_, chunk), s in self.uses.items() if chunk == c}
        if self.vertical_sync:
            needed |= set(range(self.plan.rank0_updates_before_forward(self.forwards[c]),
                                self.versions.updates[c] + 1))
        self.versions.release_below(c, needed)

    def _skip_stashes(self) -> None:
        """Stashed weights are weights, not activations: the saved-bytes count leaves them out."""
        self.recorder.saved.skip(list(dict.fromkeys(p for c in self.chunks for p in c.parameters()))
                                 + self.versions.storages())

    def stash_metrics(self) -> dict[str, float]:
        held = self.versions.peak_bytes if self.pipedream else self.versions.nbytes()
        return {"stash_mb": held / 2**20}
