"""Activation memory of a pipeline step: the bytes autograd saves for backward, live and at the peak.

Which schedule holds how many micro-batches at once is the point of 1F1B
(Narayanan et al. 2019/2021: at most p - rank on rank r, against GPipe's m,
Huang et al. 2019); this measures it on the running step. A split backward
(zero-bubble schedules) keeps a micro-batch's graph from its B to its W, and
the gradients B captured for W on top (tessel.parallel.pipeline.split_backward).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn


class SavedBytes:
    """Bytes of activations autograd saves for backward, live on this rank, and their peak.

    A saved-tensor hook sees each tensor a forward stores for its backward;
    parameters are left out (they are not activations), and a storage is
    counted once per micro-batch however many ops save views of it. The hook
    is a Python call per saved tensor (about a hundred per block forward and
    as many unpacks), a few percent of a step on small stages, so it runs only
    where the answer can change: a dense chunk saves the same bytes for every
    micro-batch of one input shape, and is measured once per (chunk, shape)
    and counted from that cache afterwards. Chunks whose saved bytes depend on
    the data (MoE dispatch) are measured on every forward.
    """

    def __init__(self, params: list[nn.Parameter], dynamic: list[bool]):
        self.param_ptrs: set[int] = set()
        self.skip(params)
        self.dynamic = dynamic  # per chunk: measure every forward
        self.live = self.peak = 0
        self._cache: dict[tuple, int] = {}
        self._seen: set[int] = set()
        self._bytes = 0

    def skip(self, params: list[nn.Parameter]) -> None:
        """Leave these parameters' storages out (again after ZeRO-3 gathers them into new ones)."""
        self.param_ptrs = {p.untyped_storage().data_ptr() for p in params}

    def start_step(self) -> None:
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in self.param_ptrs and ptr not in self._seen:
            self._seen.add(ptr)
            self._bytes += t.untyped_storage().nbytes()
        return t

    def hooks(self, key: tuple):
        """The context of one forward of chunk key[0]: the hook, or nothing when the bytes are known."""
        if key in self._cache and not self.dynamic[key[0]]:
            return contextlib.nullcontext()
        self._seen, self._bytes = set(), 0
        return torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)

    def forwarded(self, key: tuple) -> int:
        if key not in self._cache or self.dynamic[key[0]]:
            self._cache[key] = self._bytes
        nbytes = self._cache[key]
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        return nbytes

    def held(self, nbytes: int) -> None:
        """More bytes kept for a backward: a split backward's captured gradients, from its B to its W."""
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def released(self, nbytes: int) -> None:
        self.live -= nbytes


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
