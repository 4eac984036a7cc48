"""CPContext: what a cp rank's attention needs to know, passed explicitly (no module globals).

The cp process group as a ring, the mode (ring or Ulysses), this rank's
sequence positions (tessel.parallel.context.layout), and a switch for the
moments the model sees whole sequences instead of chunks: generation, where
every cp rank runs the same prompt and attention stays on the rank.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
import torch.nn.functional as F

from tessel.mesh import Mesh
from tessel.parallel.context import layout
from tessel.parallel.context.kernel import PLAIN, Scores, repeat_kv
from tessel.parallel.context.ring import Ring, ring_attention
from tessel.parallel.context.ulysses import heads_to_seq, seq_to_heads


class CPContext:
    def __init__(self, ring: Ring, mode: str):
        self.ring, self.mode = ring, mode
        self.whole = False  # True while the model sees whole sequences (generation)
        self._positions: dict[tuple[int, str], torch.Tensor] = {}

    @classmethod
    def from_mesh(cls, mesh: Mesh, mode: str) -> "CPContext":
        ring = Ring(mesh.group("cp"), tuple(mesh.group_ranks(("cp",))), mesh.coord("cp"))
        return cls(ring, mode)

    @property
    def size(self) -> int:
        return 1 if self.whole else self.ring.size

    def positions(self, local_len: int, device: torch.device) -> torch.Tensor:
        """The sequence positions of this rank's `local_len` tokens (0..T-1 for a whole sequence)."""
        key = (local_len, str(device))
        if self.size == 1:
            return torch.arange(local_len, device=device)
        if key not in self._positions:
            ids = layout.positions(local_len * self.size, self.size, self.ring.index)
            self._positions[key] = torch.tensor(ids, dtype=torch.long, device=device)
        return self._positions[key]

    @contextlib.contextmanager
    def whole_sequences(self) -> Iterator[None]:
        self.whole = True
        try:
            yield
        finally:
            self.whole = False

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None,
                  scores: Scores = PLAIN) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence; q (B, H, T, D), k and v (B, Hkv,
        T, D) with rotary already applied at this rank's positions -> (B, H, T, D). `scores`: a sliding window
        or soft-capping (tessel.parallel.context.kernel.Scores)."""
        scale = scale if scale is not None else 1 / math.sqrt(q.size(-1))
        if self.size == 1:
            return _causal(q, k, v, scale, scores)
        if self.mode == "ring":
            return ring_attention(q, k, v, self.ring, scale, scores)
        cp, group = self.ring.size, self.ring.group
        q, k, v = (seq_to_heads(t, cp, group) for t in (q, k, v))  # every position, in order
        return heads_to_seq(_causal(q, k, v, scale, scores), cp, group)


def _causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, scores: Scores = PLAIN) -> torch.Tensor:
    """The single-device attention over whole sequences in order, as the reference GPT computes it (shared kv
    heads, causal SDPA); under a window or a soft-cap written out, as transformers' eager attention is."""
    heads = q.size(1)
    k, v = repeat_kv(k, heads), repeat_kv(v, heads)
    if scores.plain:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    s = (q @ k.transpose(-2, -1)) * scale
    if scores.softcap is not None:
        s = torch.tanh(s / scores.softcap) * scores.softcap
    at = torch.arange(q.size(2), device=q.device)
    s = s.masked_fill(~scores.allowed(at, at), float("-inf"))
    return torch.softmax(s.float(), dim=-1).to(q.dtype) @ v
