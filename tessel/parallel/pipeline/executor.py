"""Executes this rank's Action list of one step on its chunks: forwards, backwards, sends, receives.

The list is the schedule's (schedules.py: GPipe, Huang et al. 2019; 1F1B,
Narayanan et al. 2019 and 2021; interleaved 1F1B, Narayanan et al. 2021;
ZB-H1, ZB-H2 and ZBV, Qi et al. 2023), run as written: a compute action alone,
a run of communication actions as one batch of messages (comm.py). The
schedule, not autograd, decides when a backward runs: on the output kept from
its forward, seeded with the gradient received from the next stage. Zero-bubble
schedules split it (split_backward.py): B computes the input's gradient and
keeps the graph, W later accumulates the weights' gradients. MoE router losses
are back-propagated on their own stage (aux.py). Where two neighbouring stages
sit on one rank (the turn of ZBV's V) the activation and its gradient are
handed over in place. What the step holds between actions is a StepState; how
long each action took and what its forward saved go to the recorder.
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
from tessel.parallel.pipeline.schedules import (COMPUTE, RECVS, Action, Placement, batches, build_schedule, owner_of,
                                                splits_backward)
from tessel.parallel.pipeline.split_backward import WeightWork, backward_input
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
    weight_work: dict[Key, WeightWork] = field(default_factory=dict)  # a split backward's W, after its B
    n_posted: int = 0  # how many of the rank's receives are posted, in the schedule's order


class ScheduleExecutor:
    """Runs the schedule's actions for this rank's chunks; one step per `run`."""

    def __init__(self, chunks: Sequence[nn.Module], placement: Placement, links: StageLinks,
                 recorder: StepRecorder, spec: PipelineSpec, sync: GradientSync):
        self.chunks, self.placement, self.links = list(chunks), placement, links
        self.recorder, self.spec, self.sync = recorder, spec, sync
        self.device, self.m = links.device, spec.micro_batches
        # MoE aux losses: each stage back-propagates its own
        self.aux = list(spec.stage_losses) if spec.stage_losses is not None else [StageAux(c) for c in chunks]
        self.has_aux = any(a.present for a in self.aux)
        self.act_dtype = next(self.chunks[0].parameters()).dtype  # the residual stream's dtype
        self.split = splits_backward(spec.schedule)  # B, then W later (split_backward.py)
        self.first_hidden: torch.Tensor | None = None  # the hidden states entering the first stage's blocks
        if self.split:
            self._watch_first_hidden()
        # gloo moves a message only once its receive is posted (the sender waits for the
        # receiver's ready note), so a receive posted just before it is needed costs a round
        # trip of wake-ups. There, receives are posted RECV_LOOKAHEAD ahead of need, in the
        # schedule's order (the order messages on each link are matched in), and a stage
        # finds its input already there. Under NCCL a posted receive would hold up the sends
        # queued behind it on the same stream, so receives stay in the schedule's batches.
        self.prepost = links.group is not None and dist.get_backend(links.group) == "gloo"
        self._plan(self.step_actions(0))

    def step_actions(self, step: int) -> list[Action]:
        """This rank's list for a step: the schedule's, the same every step."""
        return build_schedule(self.spec.schedule, self.placement.p, self.m, self.placement.v)[self.placement.rank]

    def _plan(self, actions: list[Action]) -> None:
        self.actions = actions
        self.items = batches(actions)
        # the computes that accumulate weight gradients: where data parallelism reduces
        backwards = [a for a in actions if a.kind == ("W" if self.split else "B")]
        self.last_backward = set({a.chunk: a for a in backwards}.values())  # each chunk's last
        self.final_backward = backwards[-1] if backwards else None
        self.recv_order = [a for a in actions if a.kind in RECVS]
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
            elif a.kind == "B":
                self._backward(a, received, state)
            else:
                self._weights(a, state)
            clock.add(a.kind, a.mb, a.chunk, start, clock.stamp())

    # ---- compute ---------------------------------------------------------------------
    def _forward(self, a: Action, received: torch.Tensor | None, state: StepState) -> None:
        key = (a.mb, a.chunk)
        inp = state.inputs[a.mb] if received is None else received.requires_grad_(True)
        saved, shape_key = self.recorder.saved, (a.chunk, tuple(inp.shape), inp.dtype)
        with saved.hooks(shape_key), autocast_for(self.device, self.spec.precision):
            out = self._with_losses(a, self._run_chunk(a, inp), state)
        state.saved_bytes[key] = saved.forwarded(shape_key)
        if self.first_hidden is not None and self.placement.is_first(a.chunk):
            inp, self.first_hidden = self.first_hidden, None  # B's cut on the first stage (split backward)
        state.chunk_inputs[key], state.outputs[key] = inp, out
        if self.placement.is_last(a.chunk):
            state.loss += out.detach()

    def _run_chunk(self, a: Action, inp: torch.Tensor) -> torch.Tensor:
        return self.chunks[a.chunk](inp)

    def _targets(self, state: StepState, mb: int) -> torch.Tensor:
        return state.targets[mb]

    def _with_losses(self, a: Action, out: torch.Tensor, state: StepState) -> torch.Tensor:
        """The last stage's output becomes its loss; elsewhere MoE aux losses ride on the activation."""
        aux = self.aux[a.chunk]()  # this micro-batch's router losses on this chunk
        if self.placement.is_last(a.chunk):
            # mean over micro-batches: each contributes 1/m of the step's loss
            out = self.spec.loss_fn(out, self._targets(state, a.mb)) / self.m
            return out + aux / self.m if aux is not None else out
        if aux is not None:
            state.aux += aux.detach() / self.m
            return AttachAuxLoss.apply(out, aux, 1.0 / self.m)
        return out

    def _backward(self, a: Action, received: torch.Tensor | None, state: StepState) -> None:
        key = (a.mb, a.chunk)
        out = state.outputs.pop(key)
        first = self.placement.is_first(a.chunk)
        if self.split:  # B: the input's gradient only; the weights' wait for W, with the graph
            inp = state.chunk_inputs[key]
            dx, work = backward_input(out, received, inp if inp.is_floating_point() else None)
            if not first:
                inp.grad = dx
            state.weight_work[key] = work
            held = work.nbytes
            state.saved_bytes[key] += held
            self.recorder.saved.held(held)
        else:
            self.sync.before_backward(a.chunk, chunk_done=a in self.last_backward,
                                      rank_done=a == self.final_backward)
            torch.autograd.backward(out, received)  # received is None on the last stage: out is the loss
            self.recorder.saved.released(state.saved_bytes.pop(key))
        if first:
            state.chunk_inputs.pop(key)  # token ids: nothing to send back

    def _weights(self, a: Action, state: StepState) -> None:
        """W: this micro-batch's weight gradients, accumulated (data parallelism reduces on the chunk's last)."""
        key = (a.mb, a.chunk)
        self.sync.before_backward(a.chunk, chunk_done=a in self.last_backward, rank_done=a == self.final_backward)
        state.weight_work.pop(key).run()
        self.recorder.saved.released(state.saved_bytes.pop(key))  # the graph and the captured gradients

    def _watch_first_hidden(self) -> None:
        """Keep the hidden states entering the first stage's first block: B's cut there, so the blocks' input
        path runs in B and only the weight branches (and the embedding) wait for W."""
        for c, chunk in enumerate(self.chunks):
            if self.placement.is_first(c):
                first_block = next(iter(chunk.get_submodule(self.spec.blocks).children()))
                first_block.register_forward_pre_hook(self._first_block_called, with_kwargs=True)

    def _first_block_called(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        hidden = args[0] if args else kwargs.get("hidden_states")
        if torch.compiler.is_compiling():
            # traced into a compiled chunk (train.compile = "model"): the hidden states are inside its one
            # autograd node, no edge B could cut at; W runs the chunk's whole backward
            return
        if torch.is_grad_enabled() and isinstance(hidden, torch.Tensor) and hidden.requires_grad:
            self.first_hidden = hidden

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
        if a.kind == "W":
            return None
        local = self._local_input(a, state)
        if local is not None:
            return local
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

    def _local_input(self, a: Action, state: StepState) -> torch.Tensor | None:
        """The turn of a V: the neighbouring stage is this rank's other chunk, its tensor is at hand."""
        p, s, last = self.placement.p, self.placement.stage(a.chunk), self.placement.p * self.placement.v - 1
        src = s - 1 if a.kind == "F" else s + 1
        if not 0 <= src <= last:
            return None
        owner, chunk = owner_of(p, src, self.placement.vshape)
        if owner != self.placement.rank:
            return None
        if a.kind == "F":  # a leaf of this chunk's graph; the other chunk's output stays for its backward
            return state.outputs[(a.mb, chunk)].detach()
        return state.chunk_inputs.pop((a.mb, chunk)).grad

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
        pl = self.placement
        shape = self.spec.act_shape(idx.size(0), idx.size(1))
        out = None
        for c, chunk in enumerate(self.chunks):
            s = pl.stage(c)
            inp = idx if pl.is_first(c) else out  # out: the previous stage, when this rank ran it (a V's turn)
            prev = owner_of(pl.p, s - 1, pl.vshape)[0] if s > 0 else pl.rank
            if prev != pl.rank:
                (incoming,) = self.links.exchange([], [(prev, shape, self.act_dtype)])
                incoming.work.wait()
                inp = incoming.buffer
            with autocast_for(self.device, self.spec.precision):
                out = chunk(inp)
            nxt = owner_of(pl.p, s + 1, pl.vshape)[0] if not pl.is_last(c) else pl.rank
            if nxt != pl.rank:
                self.links.exchange([(nxt, out)], [])
                out = None
        self.links.wait_sends()
        return out
