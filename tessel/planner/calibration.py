"""What tessel.calibrate measured on this machine, as the planner reads it (pure data and interpolation)."""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field


@dataclass
class Calibration:
    """Measured on this machine by tessel.calibrate.profile.profile_model; None fields fall back to the cluster."""
    # (tokens per micro-batch, achieved FLOP/s of a full forward+backward at that size)
    flops_points: list[tuple[int, float]] = field(default_factory=list)
    opt_s_per_param: float | None = None  # clip + AdamW step, seconds per parameter on this rank
    step_overhead_s: float = 0.0  # data, loss all-reduce, Python: per step, independent of the model
    # tp degree -> the same points for the model as one tp rank computes it (without its
    # collectives), in whole-model FLOPs per second: smaller matrices run less efficiently
    tp_points: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    # tp degree -> (tokens per micro-batch, seconds its tp collectives added to a whole-model
    # forward+backward when issued between the matmuls, as the trainer issues them)
    tp_comm: dict[int, list[tuple[int, float]]] = field(default_factory=dict)

    def achieved(self, tokens: int, fallback: float, tp: int = 1) -> float:
        """Whole-model FLOP/s of one rank at a micro-batch of `tokens` under `tp`, log-linear
        between measured sizes, flat outside.

        Without a profile of that tp degree, a tp-sharded matmul is priced like
        an unsharded one on tokens/tp rows (the same work per call), tp times faster.
        """
        if tp in self.tp_points:
            return interpolate(self.tp_points[tp], tokens, fallback)
        if tp == 1:
            return interpolate(self.flops_points, tokens, fallback)
        return tp * interpolate(self.tp_points.get(1, self.flops_points), max(1, tokens // tp), fallback / tp)


def interpolate(points: list[tuple[int, float]], tokens: int, fallback: float) -> float:
    """The measured value at `tokens`: log-linear between the points, flat outside, `fallback` without any."""
    pts = sorted(points)
    if not pts:
        return fallback
    xs = [t for t, _ in pts]
    if tokens <= xs[0]:
        return pts[0][1]
    if tokens >= xs[-1]:
        return pts[-1][1]
    i = bisect.bisect_right(xs, tokens)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    w = (math.log(tokens) - math.log(x0)) / (math.log(x1) - math.log(x0))
    return math.exp((1 - w) * math.log(y0) + w * math.log(y1))
