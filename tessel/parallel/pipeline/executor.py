"""Executes this rank's Action list of one step on its chunks: forwards, backwards, sends, receives.

The list is the schedule's (schedules.py: GPipe, Huang et al. 2019; 1F1B,
Narayanan et al. 2019 and 2021; interleaved 1F1B, Narayanan et al. 2021), run
as written: a compute action alone, a run of communication actions as one batch
of messages (comm.py). The schedule, not autograd, decides when a backward
runs: on the output kept from its forward, seeded with the gradient received
from the next stage. MoE router losses are back-propagated on their own stage
(aux.py). What the step holds between actions is a StepState; how long each
action took and what its forward saved go to the recorder.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.parallel.pipeline.aux import AttachAuxLoss, StageAux
from tessel.parallel.pipeline.comm import Incoming, StageLinks
from tessel.parallel.pipeline.grad_sync import GradientSync
from tessel.parallel.pipeline.recorder import StepRecorder
from tessel.parallel.pipeline.schedules import COMPUTE, RECVS, Action, Placement, batches, build_schedule
from tessel.parallel.pipeline.spec import PipelineSpec
from tessel.parallel.runner import autocast_for

RECV_LOOKAHEAD = 2  # receives posted ahead of need under gloo (each holds one activation buffer)

Key = tuple[int, int]  # (micro-batch, chunk)
RecvKey = tuple[str, int, int]  # (RF | RB, micro-batch, chunk)


@dataclass
class StepState:
    """What one step holds between its actions."""
    inputs: tuple[torch.Tensor, ...]  # the step's micro-batches of token ids, (B/m, T) each
    targets: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]  # of every activation and gradient message: (B/m, T/seq_shards, C)
    loss: torch.Tensor  # on the last stage: the sum over micro-batches of (loss + aux) / m
    aux: torch.Tensor  # the MoE aux losses of this rank's other chunks, / m
    chunk_inputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # their .grad is sent back
    outputs: dict[Key, torch.Tensor] = field(default_factory=dict)  # kept until the backward (last stage: the loss)
    posted: dict[RecvKey, Incoming] = field(default_factory=dict)  # receives not waited on yet
    saved_bytes: dict[Key, int] = field(default_factory=dict)  # what each forward saved, until its backward
    n_posted: int = 0  # how many of the rank's receives are posted, in the schedule's order


class ScheduleExecutor:
    """Runs the schedule's actions for this rank's chunks; one step per `run`."""

    def __init__(self, chunks: Sequence[nn.Module], placement: Placement, links: StageLinks,
                 recorder: StepRecorder, spec: PipelineSpec, sync: GradientSync):
        self.chunks, self.placement, self.links = list(chunks), placement, links
        self.recorder, self.spec, self.sync = recorder, spec, sync
        self.device, self.m = links.device, spec.micro_batches
        self.actions = build_schedule(spec.schedule, placement.p, spec.micro_batches, placement.v)[placement.rank]
        self.items = batches(self.actions)
        # MoE aux losses: each stage back-propagates its own
        self.aux = list(spec.stage_losses) if spec.stage_losses is not None else [StageAux(c) for c in chunks]
        self.has_aux = any(a.present for a in self.aux)
        self.act_dtype = next(self.chunks[0].parameters()).dtype  # the residual stream's dtype
        backwards = [a for a in self.actions if a.kind == "B"]
        self.last_backward = set({a.chunk: a for a in backwards}.values())  # each chunk's last
        self.final_backward = backwards[-1]
        # gloo moves a message only once its receive is posted (the sender waits for the
        # receiver's ready note), so a receive posted just before it is needed costs a round
        # trip of wake-ups. There, receives are posted RECV_LOOKAHEAD ahead of need, in the
        # schedule's order (the order messages on each link are matched in), and a stage
        # finds its input already there. Under NCCL a posted receive would hold up the sends
        # queued behind it on the same stream, so receives stay in the schedule's batches.
        self.prepost = links.group is not None and dist.get_backend(links.group) == "gloo"
        self.recv_order = [a for a in self.actions if a.kind in RECVS]
        self.recv_pos = {(a.kind, a.mb, a.chunk): i for i, a in enumerate(self.recv_order)}

    def new_state(self, x: torch.Tensor, y: torch.Tensor) -> StepState:
        xs, ys = x.to(self.device).chunk(self.m), y.to(self.device).chunk(self.m)
        if len(xs) != self.m or len({t.size(0) for t in xs}) != 1:
            raise ValueError(f"batch of {x.size(0)} does not split into {self.m} equal micro-batches")
        # known ahead, so no shape messages; under sequence parallelism each rank's tokens
        shape = self.spec.act_shape(xs[0].size(0), x.size(1))
        return StepState(xs, ys, shape, loss=torch.zeros((), device=self.device),
                         aux=torch.zeros((), device=self.device))

    def run(self, state: StepState) -> None:
        """Every action of the step; sends may still be in flight at the end (links.wait_sends)."""
        clock = self.recorder.clock
        if self.prepost:
            self._post_receives(RECV_LOOKAHEAD, state)
        for item in self.items:
            a = item[0]
            if a.kind not in COMPUTE:
                self._communicate(item, state)
                continue
            received = self._await_input(a, state)
            start = clock.stamp()
            if a.kind == "F":
                self._forward(a, received, state)
            else:
                self._backward(a, received, state)
            clock.add(a.kind, a.mb, a.chunk, start, clock.stamp())

    # ---- compute ---------------------------------------------------------------------
    def _forward(self, a: Action, received: torch.Tensor | None, state: StepState) -> None:
        key = (a.mb, a.chunk)
        inp = state.inputs[a.mb] if received is None else received.requires_grad_(True)
        saved, shape_key = self.recorder.saved, (a.chunk, tuple(inp.shape), inp.dtype)
        with saved.hooks(shape_key), autocast_for(self.device, self.spec.precision):
            out = self._with_losses(a, self.chunks[a.chunk](inp), state)
        state.saved_bytes[key] = saved.forwarded(shape_key)
        state.chunk_inputs[key], state.outputs[key] = inp, out
        if self.placement.is_last(a.chunk):
            state.loss += out.detach()

    def _with_losses(self, a: Action, out: torch.Tensor, state: StepState) -> torch.Tensor:
        """The last stage's output becomes its loss; elsewhere MoE aux losses ride on the activation."""
        aux = self.aux[a.chunk]()  # this micro-batch's router losses on this chunk
        if self.placement.is_last(a.chunk):
            # mean over micro-batches: each contributes 1/m of the step's loss
            out = self.spec.loss_fn(out, state.targets[a.mb]) / self.m
            return out + aux / self.m if aux is not None else out
        if aux is not None:
            state.aux += aux.detach() / self.m
            return AttachAuxLoss.apply(out, aux, 1.0 / self.m)
        return out

    def _backward(self, a: Action, received: torch.Tensor | None, state: StepState) -> None:
        key = (a.mb, a.chunk)
        out = state.outputs.pop(key)
        self.sync.before_backward(a.chunk, chunk_done=a in self.last_backward, rank_done=a == self.final_backward)
        torch.autograd.backward(out, received)  # received is None on the last stage: out is the loss
        if self.placement.is_first(a.chunk):
            state.chunk_inputs.pop(key)  # token ids: nothing to send back
        self.recorder.saved.released(state.saved_bytes.pop(key))

    # ---- communication -----------------------------------------------------------------
    def _communicate(self, item: list[Action], state: StepState) -> None:
        """One batch of sends (and, unless pre-posted, receives), as the schedule groups them."""
        sends, recvs = [], []
        for a in item:
            key = (a.mb, a.chunk)
            if a.kind == "SF":
                sends.append((a.peer, state.outputs[key].detach()))
            elif a.kind == "SB":
                sends.append((a.peer, state.chunk_inputs.pop(key).grad))
            elif not self.prepost:
                recvs.append(a)
        clock = self.recorder.clock
        start = clock.stamp()
        incoming = self.links.exchange(sends, [(a.peer, state.shape, self.act_dtype) for a in recvs])
        state.posted.update({(a.kind, a.mb, a.chunk): inc for a, inc in zip(recvs, incoming)})
        end = clock.stamp()
        for a in item:
            if a.kind not in RECVS:  # a receive's event closes when its wait does
                clock.add(a.kind, a.mb, a.chunk, start, end)

    def _await_input(self, a: Action, state: StepState) -> torch.Tensor | None:
        """The activation (F) or gradient (B) this compute needs; the wait is a receive event."""
        kind = "RF" if a.kind == "F" else "RB"
        pos = self.recv_pos.get((kind, a.mb, a.chunk))
        if pos is None:
            return None  # first stage's forward, last stage's backward: nothing to receive
        if self.prepost:  # keep the next receives posted while this one is waited on
            self._post_receives(pos + 1 + RECV_LOOKAHEAD, state)
        incoming = state.posted.pop((kind, a.mb, a.chunk))
        clock = self.recorder.clock
        start = clock.stamp()  # the event is the time blocked, not the time since posting
        incoming.work.wait()
        clock.add(kind, a.mb, a.chunk, start, clock.stamp())
        return incoming.buffer

    def _post_receives(self, upto: int, state: StepState) -> None:
        """Post this step's receives up to position `upto` of the rank's receive order."""
        upto = min(upto, len(self.recv_order))
        if state.n_posted >= upto:
            return
        todo = self.recv_order[state.n_posted:upto]
        incoming = self.links.exchange([], [(a.peer, state.shape, self.act_dtype) for a in todo])
        state.posted.update({(a.kind, a.mb, a.chunk): inc for a, inc in zip(todo, incoming)})
        state.n_posted = upto

    # ---- without a schedule ------------------------------------------------------------
    def forward_only(self, idx: torch.Tensor) -> torch.Tensor | None:
        """One batch down every virtual stage, no gradients; the last stage's output (None elsewhere)."""
        p, rank = self.placement.p, self.placement.rank
        shape = self.spec.act_shape(idx.size(0), idx.size(1))
        out = None
        for c, chunk in enumerate(self.chunks):
            inp = idx
            if not self.placement.is_first(c):
                (incoming,) = self.links.exchange([], [((rank - 1) % p, shape, self.act_dtype)])
                incoming.work.wait()
                inp = incoming.buffer
            with autocast_for(self.device, self.spec.precision):
                out = chunk(inp)
            if not self.placement.is_last(c):
                self.links.exchange([((rank + 1) % p, out)], [])
                out = None
        self.links.wait_sends()
        return out
