"""train.fused_loss moves the head's matmul into the loss (tessel.parallel.fused_loss): vocabulary-parallel
under 1D tp; a grid mode (2d / 2.5d / 3d) splits the head's hidden dimension over its grid too, where the
chunked loss would need the grid's own matmuls. A Hugging Face model must be of a type whose forward does
nothing to the head's output that the loss would miss (tessel.hf.head reads its forward)."""

from __future__ import annotations

from tessel.config.rule import Rule
from tessel.hf.head import hf_fused_loss_refusal
from tessel.hf.shape import read_config


def _fused(c) -> bool:
    return c.train.fused_loss


def _hf_why(c) -> str | None:
    return hf_fused_loss_refusal(read_config(c.model.hf_config))


RULES = [
    Rule("train.fused_loss", lambda c: c.parallel.tp == 1 or c.parallel.tp_mode == "1d",
         lambda c: f"fuses the vocabulary-parallel head of 1D tensor parallelism; tp_mode {c.parallel.tp_mode!r} "
         "also splits the head's hidden dimension over its grid (set train.fused_loss = false, or "
         "parallel.tp_mode = '1d')", when=_fused),
    Rule("train.fused_loss", lambda c: _hf_why(c) is None, lambda c: str(_hf_why(c)),
         when=lambda c: _fused(c) and c.model.hf_config is not None),
]
