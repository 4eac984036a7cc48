"""Deterministic fault injection for tests and drills.

TESSEL_FAULT="kill:rank=2:step=5,stop:rank=1:step=3,nan:rank=0:step=4:count=3,
slow:rank=1:step=2:seconds=0.3" fires each fault once across restarts (a
marker file per fault in TESSEL_FAULT_DIR or the checkpoint directory).
`slow:rank=1:step=4:factor=3:count=100` makes rank 1's compute 3x slower for
100 steps from step 4: a device that slows down (tessel.train.fault.guard).
"""

from __future__ import annotations

import hashlib
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path

from tessel.heartbeat import log


@dataclass
class Fault:
    kind: str  # kill | stop | nan | slow
    rank: int = 0
    step: int = 0
    count: int = 1
    seconds: float = 0.0
    factor: float = 1.0  # slow: compute takes this many times as long (with seconds = 0)
    spec: str = ""
    remaining: int = field(default=0)


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in (text or "").split(","))):
        kind, *fields = spec.split(":")
        if kind not in ("kill", "stop", "nan", "slow"):
            raise ValueError(f"TESSEL_FAULT: unknown fault kind {kind!r} in {spec!r}")
        kw = dict(f.split("=", 1) for f in fields)
        if float(kw.get("factor", 1.0)) <= 0:
            raise ValueError(f"TESSEL_FAULT: factor must be positive in {spec!r}")
        faults.append(Fault(kind, int(kw.get("rank", 0)), int(kw.get("step", 0)), int(kw.get("count", 1)),
                            float(kw.get("seconds", 0.0)), float(kw.get("factor", 1.0)), spec))
    return faults


class FaultInjector:
    """Fires TESSEL_FAULT's faults on this rank, each once across restarts."""

    def __init__(self, rank: int, marker_dir: Path, text: str | None = None):
        # a fault belongs to the process (the device) it was aimed at, not to the number an eviction
        # gave it later (tessel.elastic.adaptive.regroup keeps the first in TESSEL_LAUNCH_RANK)
        rank = int(os.environ.get("TESSEL_LAUNCH_RANK", rank))
        self.rank = rank
        self.faults = [f for f in parse_faults(text if text is not None else os.environ.get("TESSEL_FAULT"))
                       if f.rank == rank]
        self.marker_dir = Path(os.environ.get("TESSEL_FAULT_DIR") or marker_dir)

    def _marker(self, f: Fault) -> Path:
        return self.marker_dir / f".fault-{hashlib.sha1(f.spec.encode()).hexdigest()[:12]}"

    def _claim(self, f: Fault) -> bool:
        """True the first time (across restarts) this fault reaches its step."""
        marker = self._marker(f)
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f.spec)
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.step == step and f.kind in ("kill", "stop") and self._claim(f):
                log(f"[tessel fault] injecting {f.kind} on rank {self.rank} at step {step}")
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            if f.step == step and f.kind == "nan" and self._claim(f):
                f.remaining = f.count

    def slow_seconds(self, step: int) -> float:
        return sum(f.seconds for f in self.faults if f.kind == "slow" and f.step <= step < f.step + f.count)

    def slow_factor(self, step: int) -> float:
        """How many times as long this rank's compute takes at `step` (1: its own speed)."""
        factor = 1.0
        for f in self.faults:
            if f.kind == "slow" and f.step <= step < f.step + f.count:
                factor *= f.factor
        return factor

    def poison(self, params) -> bool:
        """Turn one gradient NaN while a nan fault is active (after backward, before the step)."""
        for f in self.faults:
            if f.kind == "nan" and f.remaining > 0:
                f.remaining -= 1
                for p in params:
                    if p.grad is not None:
                        p.grad.view(-1)[0] = float("nan")
                        return True
        return False

    def cancel(self) -> None:
        """A rollback ends active faults (they fire once, not again on the replayed steps)."""
        for f in self.faults:
            f.remaining = 0
