"""Which tokens of a sequence each cp rank holds: the load-balanced ("zigzag") layout, pure arithmetic.

Under causal attention the query at position i attends to i+1 keys, so
cutting the sequence into cp contiguous pieces would give the last rank cp
times the work of the first. The sequence is cut into 2*cp equal chunks and
rank r holds chunk r (from the head) and chunk 2cp-1-r (from the tail): every
rank then does the same attention work (Brandon et al. 2023, "Striped
Attention", call this imbalance out; the head-and-tail pairing is
the "zigzag" layout of ring-flash-attention and Megatron-Core's
context parallelism). cp = 4, 8 chunks:

    rank 0: [0, 7]   rank 1: [1, 6]   rank 2: [2, 5]   rank 3: [3, 4]

One layout for ring and Ulysses attention alike, so data, rotary positions,
the loss and checkpoints never depend on the attention's mode. Torch-free: the
sampler (tessel.train.data) cuts its batches with it.
"""

from __future__ import annotations


def rank_chunks(rank: int, cp: int) -> tuple[int, int]:
    """The two chunks (of 2*cp) rank `rank` holds: one from the head, one from the tail."""
    return rank, 2 * cp - 1 - rank


def positions(seq_len: int, cp: int, rank: int) -> list[int]:
    """The sequence positions rank `rank` of cp holds, in the order it holds them (head chunk first)."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens does not split into 2*cp = {2 * cp} chunks")
    size = seq_len // (2 * cp)
    return [c * size + i for c in rank_chunks(rank, cp) for i in range(size)]
