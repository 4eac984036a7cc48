"""PipelineRunner: the tessel.parallel.runner.Runner of a pipeline, composed of its parts.

The trainer does not know a pipeline is there: forward_backward(x, y) returns
the step's mean loss on every rank, evaluate() and generate() run through the
stages. The work is done by
- the executor (executor.py): this rank's Action list of the schedule, run on its chunks;
- the gradient synchroniser (grad_sync.py): dp per chunk, ZeRO over all chunks, the tied embedding;
- the recorder (recorder.py): bubble, saved-activation peak, Chrome trace and Gantt chart.
An asynchronous pipeline (PipeDream, 2BW) runs on async_executor.py's executor,
whose steps continue each other.
What is left here is the order of a step and the loss every rank reports.
Under TP the chunks are already tensor-parallel (each rank pipelines with the
ranks of its own dp/ep/tp coordinates) and the loss is the vocab-parallel one.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.models.moe import moe_layers
from tessel.parallel.pipeline.async_executor import AsyncExecutor, UpdatedInPipeline
from tessel.parallel.pipeline.async_schedules import is_async
from tessel.parallel.pipeline.comm import Incoming, StageLinks
from tessel.parallel.pipeline.executor import ScheduleExecutor, StepState
from tessel.parallel.pipeline.grad_sync import GradientSync
from tessel.parallel.pipeline.recorder import StepRecorder
from tessel.parallel.pipeline.saved import SavedBytes
from tessel.parallel.pipeline.schedules import Placement, is_vshape, owner_of
from tessel.parallel.pipeline.spec import PipelineSpec
from tessel.parallel.runner import CheckpointableOptimizer, autocast_for, generate_tokens, strip_wrappers
from tessel.parallel.zero.zero_parallel import ZeroDataParallel


class PipelineRunner:
    """One pipeline rank's chunks behind the Runner protocol."""

    after_update: Sequence[Callable[[], None]] = ()  # tessel.apply sets the plan's

    def __init__(self, chunks: Sequence[nn.Module], mesh: Mesh, spec: PipelineSpec, sync: GradientSync,
                 optimizer: CheckpointableOptimizer | None = None,
                 micro_optimizer: torch.optim.Optimizer | None = None, vertical_sync: bool = False):
        """micro_optimizer: PipeDream's, stepped by the pipeline after every micro-batch (the trainer then
        gets a handle whose step does nothing); vertical_sync: PipeDream's option (weight_versions.py)."""
        self.chunks, self.spec, self.sync = list(chunks), spec, sync
        self.optimizer = optimizer  # ZeRO's (None: the trainer builds AdamW over parameters())
        if micro_optimizer is not None:
            self.optimizer = UpdatedInPipeline(micro_optimizer)
        self.placement = Placement(mesh.size("pp"), len(self.chunks), mesh.coord("pp"), is_vshape(spec.schedule))
        self.links = StageLinks(mesh, owner_of(self.placement.p, self.placement.p * self.placement.v - 1,
                                               self.placement.vshape)[0])
        p, v = self.placement.p, self.placement.v
        title = f"{spec.schedule}: pp={p}, micro-batches={spec.micro_batches}" + (f", virtual stages={v}" if v > 1 else "")
        # chunks whose saved bytes depend on the data (MoE dispatch) are measured every forward
        saved = SavedBytes(self.parameters(), [bool(moe_layers(c)) for c in self.chunks])
        self.recorder = StepRecorder(mesh, saved, title)
        if is_async(spec.schedule):  # PipeDream, 2BW: steps continue each other (async_executor.py)
            self.executor = AsyncExecutor(self.chunks, self.placement, self.links, self.recorder, spec, sync,
                                          micro_optimizer, vertical_sync)
        else:
            self.executor = ScheduleExecutor(self.chunks, self.placement, self.links, self.recorder, spec, sync)
        # under gloo the loss comes from the last rank as a message posted at the step's start and
        # sent when that rank is done, so no rank ends its step in a synchronous broadcast (torch
        # keeps the loss on the last stage only; the trainer wants it everywhere). MoE losses have
        # parts on every stage and are summed over the pipeline instead.
        self.loss_by_message = self.executor.prepost and not self.executor.has_aux
        self.timeline = True  # write_timeline draws the last step (tests switch it off for speed)

    # ---- the Runner protocol ---------------------------------------------------------
    def parameters(self) -> list[nn.Parameter]:
        return list(dict.fromkeys(p for c in self.chunks for p in c.parameters()))

    def named_checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """Parameters and persistent buffers (live tensors) under the full model's names, for checkpoints."""
        return {strip_wrappers(name): t for chunk in self.chunks
                for name, t in chunk.state_dict(keep_vars=True).items()}

    def timed_modules(self) -> list[nn.Module]:
        return list(self.chunks)

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with self.gathered():
            self.recorder.start_step()
            state = self.executor.new_state(x, y)
            loss_in = self.links.expect_from_last() if self.loss_by_message else None
            self.executor.run(state)
            if self.loss_by_message and self.placement.rank == self.links.loss_rank:
                self.links.send_to_all(state.loss)
            self.links.wait_sends()
            self.sync.after_flush()  # the tied embedding's sum, ZeRO's deferred reduction
            self.recorder.step_done()
            return self._step_loss(state, loss_in)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        loss = torch.zeros((), device=self.links.device)
        with self.gathered():  # the loss too: a fused one reads the head's weight (tessel.parallel.fused_loss)
            out = self.executor.forward_only(x.to(self.links.device))
            if out is not None:
                with autocast_for(self.links.device, self.spec.precision):
                    loss = self.spec.loss_fn(out, y.to(self.links.device)).detach().float()
        return self.links.broadcast_from_last(loss)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, new_tokens: int, seed: int, temperature: float = 0.8,
                 top_k: int | None = 40) -> torch.Tensor:
        """Every pipeline rank runs this loop; the last samples and broadcasts each token."""
        with self.gathered():
            return generate_tokens(prompt.to(self.links.device), new_tokens, seed, self.spec.max_seq_len,
                                   self._last_logits, share=self.links.broadcast_from_last,
                                   temperature=temperature, top_k=top_k)

    def extra_metrics(self) -> dict[str, float]:
        """The last step's bubble fraction and saved-activation peaks; collective over the pipeline."""
        extra = self.spec.extra_metrics() if self.spec.extra_metrics is not None else {}
        if isinstance(self.executor, AsyncExecutor):
            extra = {**extra, **self.executor.stash_metrics()}  # this rank's stashed weight versions
        return {**self.recorder.step_metrics(), **extra}

    def write_timeline(self, out_dir: str) -> dict[str, str]:
        """Collective: the last step's events of one pipeline -> trace.json and gantt.png (rank 0 writes)."""
        return self.recorder.write_timeline(out_dir) if self.timeline else {}

    # ---- beyond the protocol: this rank's stage, for tests and weight checks ------------
    @property
    def zero(self) -> ZeroDataParallel | None:
        return self.sync.zero

    def named_parameters(self) -> dict[str, nn.Parameter]:
        """This rank's parameters under their names in the full model."""
        return {n: p for c in self.chunks for n, p in c.named_parameters(remove_duplicate=False)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {n: t for c in self.chunks for n, t in c.state_dict().items()}

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every chunk's parameters whole for the duration: a step, an evaluation, a weight check."""
        with self.sync.whole_parameters() as regathered:
            if regathered:  # new storages (ZeRO-3): keep them out of the saved-activation count
                self.recorder.saved.skip(self.parameters())
            yield

    # ---- the pieces of a step --------------------------------------------------------------
    def _step_loss(self, state: StepState, loss_in: Incoming | None) -> torch.Tensor:
        """The step's loss on every pipeline rank."""
        if self.executor.has_aux:  # every stage adds its aux losses to the loss it reports
            return self.links.sum_over_pipeline(state.loss + state.aux)
        if loss_in is not None:
            loss_in.work.wait()
            return loss_in.buffer
        return state.loss if self.loss_by_message else self.links.broadcast_from_last(state.loss)

    def _last_logits(self, window: torch.Tensor) -> torch.Tensor | None:
        """The (B, V) logits of the window's last token on the last stage; None elsewhere."""
        window, last = self._split_window(window)
        window = window.repeat(self.spec.grid_shards[0], 1)  # a tp grid: every batch chunk holds the whole prompt
        logits = self.executor.forward_only(window)
        if logits is None:
            return None
        logits = logits[:, last: last + 1].contiguous()
        if self.spec.gather_vocab is not None:
            logits = self.spec.gather_vocab(logits)  # (B, 1, V_padded), collective over tp
        return logits[:, -1, : self.spec.vocab_size]

    def _split_window(self, idx: torch.Tensor) -> tuple[torch.Tensor, int]:
        """A window whose length sequence parallelism can split, and the position of its last token.

        Padded on the right (causal attention: the padding cannot change earlier
        logits), or trimmed on the left where padding would pass max_seq_len."""
        T, n, max_len = idx.size(1), self.spec.seq_shards, self.spec.max_seq_len
        if n == 1 or T % n == 0:
            return idx, T - 1
        if max_len is None or T + n - T % n <= max_len:
            return torch.nn.functional.pad(idx, (0, n - T % n)), T - 1
        return idx[:, T % n:], T - T % n - 1
