"""Which weights an asynchronous pipeline's micro-batch sees: weight stashing (PipeDream) and double-buffered
weights (PipeDream-2BW).

An asynchronous pipeline (async_schedules.py) forwards micro-batches of step k+1
while micro-batches of step k still wait for their backward, and an update falls
between the two. A backward must use the weights its forward used (its saved
activations were computed with them): "weight stashing" (Narayanan et al. 2019,
sec. 3.3). Here a micro-batch's forward and backward run on a Stash, a copy of
the chunk's parameters taken when that version was current
(`torch.func.functional_call`), so the optimizer updates the parameters
themselves in place while older versions are still in use; a micro-batch's
weight gradients accumulate in its stash, and reach the parameters' `.grad`
(with data parallelism's reduction) only when an update takes them.

Versions, with W_k the weights after k updates of a stage:

- 2BW (Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training", sec. 3.1): every micro-batch of step k's batch, on every stage,
  runs its forward and its backward on W_k, the weights when step k starts;
  their gradients are summed over the batch's m micro-batches; that sum is
  complete during step k+1 (its last micro-batches' backwards run there) and
  the update at the end of step k+1 applies it: W_{k+2} = W_{k+1} - lr * g(W_k),
  the paper's W(t+1) = W(t) - v * grad f(W(t-1)). The update at the end of step 0
  has no gradient (W_1 = W_0). Two versions are stashed: W_k and W_{k-1}.
- PipeDream (Narayanan et al. 2019, sec. 3.3): a stage updates after every
  micro-batch's backward (W), with that micro-batch's gradient alone. A
  micro-batch's forward on stage r uses the stage's newest weights at that
  moment (W_u, u its updates so far) and its backward the same W_u. Different
  stages of one micro-batch see different versions: stage r is p - r updates
  behind its newest weights when the gradient lands. With vertical sync
  (sec. 3.3) every stage uses the version rank 0 had at the micro-batch's
  forward there (u = rank 0's updates before it; later stages keep older
  versions for it). Up to p - r versions are stashed on stage r (more with
  vertical sync).
"""

from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn


class Stash:
    """One weight version of a chunk: leaf copies of its parameters; gradients accumulate in them."""

    def __init__(self, chunk: nn.Module):
        self.names = [n for n, _ in chunk.named_parameters()]
        self.tensors = {n: torch.empty_like(p).requires_grad_(p.requires_grad) for n, p in chunk.named_parameters()}
        self.version = -1

    def load(self, chunk: nn.Module, version: int) -> None:
        """This stash becomes the chunk's current weights, version `version`, with no gradient."""
        with torch.no_grad():
            for n, p in chunk.named_parameters():
                t = self.tensors[n]
                t.copy_(p)
                t.grad = None
        self.version = version

    def grads(self) -> list[torch.Tensor | None]:
        return [self.tensors[n].grad for n in self.names]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def storages(self) -> list[torch.Tensor]:
        return list(self.tensors.values())


class DoubleBuffered:
    """2BW: step k's micro-batches (mb >= 0 in its lists) run on W_k, the previous step's (mb < 0) on W_{k-1}."""

    def __init__(self, chunks: list[nn.Module]):
        self.chunks = chunks
        self.buffers = [[Stash(c) for c in chunks] for _ in range(2)]
        self.step = 0

    def start_step(self, step: int) -> None:
        """W_step is the chunks' weights now (after `step` updates): the buffer the last-but-one step used takes it."""
        self.step = step
        for c, chunk in enumerate(self.chunks):
            self.buffers[step % 2][c].load(chunk, step)

    def for_micro_batch(self, mb: int, chunk: int) -> Stash:
        return self.buffers[(self.step if mb >= 0 else self.step - 1) % 2][chunk]

    def finished(self, chunk: int) -> list[torch.Tensor | None] | None:
        """After step k's last action: the previous batch's summed gradients (complete now), or None at step 0."""
        if self.step == 0:
            return None
        return self.buffers[(self.step - 1) % 2][chunk].grads()

    def storages(self) -> list[torch.Tensor]:
        return [t for pair in self.buffers for s in pair for t in s.storages()]

    def nbytes(self) -> int:
        return sum(s.nbytes() for pair in self.buffers for s in pair)


class Stashed:
    """PipeDream: per chunk, every version some micro-batch in flight (or, with vertical sync, a future
    forward) still needs, keyed by the stage's update count; spare copies are kept for reuse."""

    def __init__(self, chunks: list[nn.Module]):
        self.chunks = chunks
        self.updates = [0] * len(chunks)  # updates each chunk (stage) has applied
        self.versions: list[dict[int, Stash]] = [{} for _ in chunks]
        self.spare: list[list[Stash]] = [[] for _ in chunks]
        self.peak_bytes = 0
        self.allocated: list[Stash] = []  # every copy ever made (their storages are not activations)

    def version(self, chunk: int, version: int) -> Stash:
        """The stash of `version` (the current one is copied on first use; older ones must be kept)."""
        have = self.versions[chunk]
        if version not in have:
            if version != self.updates[chunk]:
                raise RuntimeError(f"weight version {version} of chunk {chunk} was not kept "
                                   f"(now at {self.updates[chunk]})")
            stash = self.spare[chunk].pop() if self.spare[chunk] else self._new(chunk)
            stash.load(self.chunks[chunk], version)
            have[version] = stash
        self.peak_bytes = max(self.peak_bytes, self.nbytes())
        return have[version]

    def keep_current(self, chunk: int) -> None:
        """Vertical sync: the current version is needed by a later forward; copy it before it changes."""
        self.version(chunk, self.updates[chunk])

    def updated(self, chunk: int) -> None:
        self.updates[chunk] += 1

    def release_below(self, chunk: int, needed: Iterable[int]) -> None:
        """Versions no micro-batch uses any more go back to the spares."""
        needed = set(needed)
        have = self.versions[chunk]
        for v in [v for v in have if v not in needed]:
            self.spare[chunk].append(have.pop(v))

    def _new(self, chunk: int) -> Stash:
        stash = Stash(self.chunks[chunk])
        self.allocated.append(stash)
        return stash

    def storages(self) -> list[torch.Tensor]:
        return [t for s in self.allocated for t in s.storages()]

    def nbytes(self) -> int:
        """Bytes of the versions held now (spares not counted: they are free for reuse)."""
        return sum(s.nbytes() for have in self.versions for s in have.values())
