"""How many tokens the fused loss scores at once: one rule for the kernel and for the planner, which prices its
memory (tessel.planner.memory). Plain arithmetic, no torch: the planner imports it."""

from __future__ import annotations

import math

MAX_CHUNKS = 16  # passes over the weight's fp32 gradient sum (chunk_tokens says why)


def chunk_tokens(tokens: int, hidden: int, rows: int) -> int:
    """Tokens per chunk: a chunk's fp32 logits (n x rows) about as many elements as the hidden states
    (tokens x hidden), as Liger-Kernel chooses, so that the loss adds about the hidden states' size of memory
    whatever the vocabulary; but at most MAX_CHUNKS chunks. Each chunk reads and writes the weight's whole fp32
    gradient sum (rows x hidden: 8 bytes an entry, 12 with a bf16 product) for a matmul of only n tokens, so
    many small chunks are bound by that traffic: at GPT-2's head and 16k tokens Liger's 256-token chunks would
    move ~30 GB a step (~9 ms on an H100), 16 chunks 7 GB, while their logits stay at 1/16 of the whole
    (measured on this CPU, 2048 tokens x d 768: 64-token chunks 1.5x slower than 256-token ones). Rounded up to
    a multiple of 64 tokens (whole GEMM tiles), never more than `tokens`."""
    n = max(math.ceil(tokens * hidden / max(rows, 1)), math.ceil(tokens / MAX_CHUNKS))
    return max(1, min(tokens, 64 * math.ceil(n / 64)))
