"""An uneven data-parallel split: dp ranks run different numbers of a step's micro-batches.

Heterogeneous devices (tessel.planner.hetero): dp rank r runs k_r micro-batches
of the same size, in proportion to its speed, K = sum_r k_r in all, and the
rows of the global batch it reads are its k_r micro-batches' worth, in rank
order (tessel.train.data.BatchSampler). Every dp reduction averages over the
dp ranks (it divides by dp), so rank r scales its mean loss by

    w_r = k_r * dp / K

and the average of w_r * mean_r over the ranks is sum_r (k_r / K) * mean_r:
the mean over all K micro-batches, each of the same number of tokens. That is
the even split's loss and gradient exactly, in another summation order. Each
rank reduces once per step whatever its k_r (plain dp, ZeRO-1: their
reduction waits for the last micro-batch; tessel.config refuses the layouts
whose collectives run per micro-batch).
"""

from __future__ import annotations


def loss_weight(shares: list[int], dp_rank: int) -> float:
    """w_r = k_r * dp / K: dp rank `dp_rank`'s factor on its mean loss."""
    return shares[dp_rank] * len(shares) / sum(shares)


def rows(shares: list[int], dp_rank: int, global_batch: int) -> slice:
    """The rows of the global batch dp rank `dp_rank` reads: its micro-batches', after the lower ranks'."""
    per_unit = global_batch // sum(shares)
    start = sum(shares[:dp_rank]) * per_unit
    return slice(start, start + shares[dp_rank] * per_unit)
