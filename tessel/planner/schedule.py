"""Pipeline schedules as data: the order in which each stage runs its forward and backward ops.

An op is (kind, micro_batch, chunk): kind "F" or "B"; chunk is the virtual
stage (model chunk) index on that device, 0 unless interleaved. The cost model
reads activation memory off these lists (the peak number of forwards whose
backward has not run yet) and the simulator executes them.

- GPipe (Huang et al. 2019): all forwards, then all backwards.
- 1F1B (PipeDream-Flush, Narayanan et al. 2021): stage s runs p-s-1 warm-up
  forwards, then alternates one forward and one backward, then drains.
- Interleaved 1F1B (Narayanan et al. 2021, sec. 2.2): each device holds v
  chunks; forwards go round the chunks in groups of p micro-batches; warm-up
  is 2(p-s-1) + (v-1)p forwards. Needs m divisible by p.
"""

from __future__ import annotations

Op = tuple[str, int, int]


def gpipe(p: int, m: int, stage: int) -> list[Op]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


def one_f_one_b(p: int, m: int, stage: int) -> list[Op]:
    warmup = min(p - stage - 1, m)
    ops: list[Op] = [("F", i, 0) for i in range(warmup)]
    steady = m - warmup
    for i in range(steady):
        ops += [("F", warmup + i, 0), ("B", i, 0)]
    ops += [("B", steady + j, 0) for j in range(warmup)]
    return ops


def interleaved(p: int, m: int, stage: int, v: int) -> list[Op]:
    if m % p:
        raise ValueError(f"the interleaved schedule needs micro_batches ({m}) divisible by pp ({p})")
    total = m * v

    def fwd(k: int) -> Op:
        group = k // p
        return ("F", (group // v) * p + k % p, group % v)

    def bwd(k: int) -> Op:
        group = k // p
        return ("B", (group // v) * p + k % p, v - 1 - group % v)

    warmup = min(2 * (p - stage - 1) + (v - 1) * p, total)
    ops = [fwd(k) for k in range(warmup)]
    for i in range(total - warmup):
        ops += [fwd(warmup + i), bwd(i)]
    ops += [bwd(k) for k in range(total - warmup, total)]
    return ops


def stage_ops(schedule: str, p: int, m: int, stage: int, v: int = 1) -> list[Op]:
    if schedule == "gpipe":
        return gpipe(p, m, stage)
    if schedule == "1f1b":
        return one_f_one_b(p, m, stage)
    if schedule == "interleaved":
        return interleaved(p, m, stage, v) if v > 1 or p > 1 else one_f_one_b(p, m, stage)
    raise ValueError(f"unknown schedule {schedule!r}")


def peak_in_flight(ops: list[Op]) -> int:
    """Most chunk-forwards whose activations are held at once (forward done, backward not)."""
    live = peak = 0
    for kind, _, _ in ops:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def bubble_fraction(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of a pipeline with uniform stages and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v*m+p-1).
    """
    v = v if schedule == "interleaved" else 1
    return (p - 1) / (v * m + p - 1)
