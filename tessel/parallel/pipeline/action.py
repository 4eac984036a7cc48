"""One step of a pipeline schedule on one rank: compute a micro-batch's forward, backward or weight
gradient on a chunk, or send or receive its activation or gradient. Torch-free: the planner reads
schedules too (tessel.planner.schedule)."""

from __future__ import annotations

from dataclasses import dataclass

COMPUTE = ("F", "B", "W")  # W: the weight gradients a split backward defers (zero-bubble schedules)
SENDS = ("SF", "SB")
RECVS = ("RF", "RB")


@dataclass(frozen=True)
class Action:
    kind: str  # F, B, W (compute) | SF, SB (send) | RF, RB (receive)
    mb: int  # micro-batch
    chunk: int = 0  # model chunk on this rank (virtual stage: Placement.stage)
    peer: int | None = None  # pipeline rank at the other end of a send / receive

    def __repr__(self) -> str:
        peer = "" if self.peer is None else f"@{self.peer}"
        return f"{self.kind}{self.mb}.{self.chunk}{peer}"
