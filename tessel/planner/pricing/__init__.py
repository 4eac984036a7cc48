"""One pricer per strategy: what each parallelism adds to a step's estimate, behind one small interface.

tessel.planner.cost.CostModel.estimate walks a layout's pipeline stages and model chunks and asks every
pricer for its terms; it sums them and composes the step (the pipeline's flush, what overlaps what, the
busiest link). A pricer answers three questions, each with nothing where its strategy is off:

- `chunk_comm`: its collectives of one model chunk for one micro-batch, priced on its group (tensor, grid,
  expert and context parallelism issue them between the layers);
- `memory`: the bytes it puts on one rank of a pipeline stage, by term (parameters, gradients and optimizer
  state, activations, buffers, ...; the composer adds them in MEMORY_TERMS' order);
- `step`: what it adds to the step beyond the chunks (the pipeline's flush, exposed communication, time
  no communication overlaps, the trainer's bookkeeping, the links it holds, the bytes it sends).

The modules: data (the gradients' traffic over dp x ep x cp), zero (sharded state, its buffers, the
optimizer's update), tensor (Megatron 1D and sequence parallelism), tensor_nd (2D/2.5D/3D grids), context
(ring and Ulysses), pipeline (stages, schedules, flushes, messages), expert (the all-to-alls), recompute
(what a block keeps and runs again), trainer (the trainer's bookkeeping collectives around the step).
tessel.planner.pricing.base holds what they share: the model's sizes,
a collective's price on a group, a block's compute. A new strategy adds one module here and one entry in
CostModel's list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from tessel.planner.layout import Layout
from tessel.planner.network import NONE, Cost

# the memory terms of one rank, in the order the estimate adds them up (and reports them)
MEMORY_TERMS = ("params", "grads", "optimizer", "fp32_grads", "activations", "weight_copies", "captured_grads",
                "weight_versions", "buffers", "baseline")


@dataclass(frozen=True)
class Chunk:
    """One model chunk (virtual stage) as one rank computes it for one micro-batch."""
    layers: tuple[int, ...]
    first: bool  # holds the embedding
    last: bool  # holds the head and the loss
    tokens: int  # one rank's tokens of the micro-batch (after cp)


@dataclass(frozen=True)
class Stage:
    """One pipeline rank: the chunks it holds and what the estimate already knows of it."""
    index: int
    chunks: tuple[int, ...]
    all_chunks: tuple[tuple[int, ...], ...]  # the layers of every chunk of the model
    tokens: int
    dense: float  # parameters it holds before ZeRO (dense: sharded over dp x ep x cp; experts over dp x cp)
    expert: float
    in_flight: int  # the most chunk-forwards whose activations it holds at once

    @property
    def last(self) -> bool:
        return len(self.all_chunks) - 1 in self.chunks

    @property
    def layers_per_chunk(self) -> float:
        return sum(len(self.all_chunks[k]) for k in self.chunks) / len(self.chunks)

    @property
    def layers(self) -> list[int]:
        return [i for k in self.chunks for i in self.all_chunks[k]]


@dataclass(frozen=True)
class ChunkComm:
    """A pricer's collectives of one chunk for one micro-batch: seconds on the critical path forward and
    backward, bytes one rank sends by axis, the links they hold (summed in this order), and the line of
    Estimate.time they are reported under."""
    fwd_s: float
    bwd_s: float
    sent: dict[str, float]
    links: tuple[Cost, ...]
    time_key: str = "tp+ep comm"


@dataclass(frozen=True)
class StepTerms:
    """What a pricer adds to the whole step, each on the critical path: one flush of the schedule over the
    stages (run grad_accum times), communication no compute hides, time nothing overlaps (nor any link's
    traffic: it bounds the busiest link's wait too), and the trainer's bookkeeping (reported as overhead);
    then the links it holds, the bytes one rank sends by axis, and anything the Estimate reports besides."""
    flush_s: float = 0.0
    exposed_s: float = 0.0
    fixed_s: float = 0.0
    overhead_s: float = 0.0
    links: Cost = NONE
    sent: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)


class Pricer(Protocol):
    """One strategy's share of a step's estimate (see the module's docstring)."""

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        """Its collectives inside one chunk for one micro-batch; None where it issues none there."""

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        """Its bytes on one rank of `stage`, by MEMORY_TERMS' names; {} where it adds none."""

    def step(self, layout: Layout, chunk_times: list[list[tuple[float, float]]],
             memory: dict[str, float]) -> StepTerms | None:
        """What it adds to the step, given every chunk's (forward, backward) seconds by stage and the worst
        stage's memory; None where it adds nothing."""
