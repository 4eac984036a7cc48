"""Compute as a roofline per op: the kernels one block runs, and how long each takes on a GPU preset.

A block of tessel's GPT (tessel.models.gpt.Block) forward is a list of ops,
read off its code as one tp rank runs it under bf16 autocast:

- GEMMs, (M, N, K) per call: the q, k, v, output and MLP projections (and the
  head, the router and the experts), each priced by `gemm_seconds`: the
  output is cut into tiles that run in waves over the SMs (tile and wave
  quantization, NVIDIA's Matrix Multiplication Background User's Guide, ch. 3),
  a tile too small to feed its SM from L2 runs slower, every tile pays its
  load pipeline's fill, and nothing runs faster than the GPU's HBM can feed
  its operands (Williams et al. 2009's roofline).
- Memory-bound ops at HBM bandwidth: the norms, rotary embeddings, the
  activation function, residual adds, autocast's casts of inputs and of fp32
  weights to bf16, the loss, the weight gradients' accumulation, and (without
  a fused kernel) the attention's softmax over the T x T scores.
- The attention core: a fused (flash) kernel, priced at its measured share of
  the peak for the causal FLOPs it runs (half the square), or without one, two
  batched GEMMs and the softmax.

Backward runs each GEMM twice (input and weight gradients) and each memory-bound
op with about twice its forward traffic (the gradient in, the saved input, the
gradient out). Full recompute runs the forward again; selective recompute
(Korthikanti et al. 2022) only the attention core (rotary, the kv repeat, the
attention), as tessel.parallel.recompute does.

Byte counts are per element of the tensors named; `r` is the residual stream's
element size (fp32 parameters keep it fp32 under autocast), `a` a bf16
activation's. The cost model sums these per chunk (tessel.planner.cost); on
"this" machine compute is measured instead (tessel.calibrate.profile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from tessel.planner.cluster import Cluster

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))  # cuBLAS's Ampere tile shapes
ROTARY_BYTES = 24  # per element of q or k: read it, 6 fp32 elementwise ops on its halves, stack, cast back
CAST_BYTES = 6  # autocast's copy of an fp32 weight: read 4, write 2
FA_BWD_MATMULS = 2.5  # FlashAttention's backward runs 5 matmuls to the forward's 2 (it recomputes the scores)


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int = 1


@dataclass(frozen=True)
class Stream:
    """A memory-bound op: bytes read and written."""
    nbytes: float


@dataclass(frozen=True)
class FusedAttention:
    flops: float  # what the kernel computes (causal: half of the T x T square)
    backward: bool = False


@dataclass(frozen=True)
class Shape:
    """What one block's ops depend on (hashable: passes are memoised on it)."""
    tokens: int  # per micro-batch
    seq: int
    d_model: int
    heads: int  # per tp rank
    kv_heads: int  # per tp rank
    head_dim: int
    ffn: int  # per tp rank (MoE: the whole expert width: tp leaves experts replicated)
    mlp_matrices: int  # 3 SwiGLU, 2 GELU
    sp_tokens: int  # tokens the norms and residual adds see (t / tp under sequence parallelism)
    act: int  # bytes of a compute element: 2 bf16, 4 fp32
    resid: int  # bytes of a residual-stream element
    cast: bool  # fp32 weights cast to bf16 by autocast on every forward
    fused: bool  # fused attention kernel
    experts: int = 0  # MoE: experts on this rank (0: dense block)
    expert_rows: int = 0  # MoE: token rows each local expert computes
    router: int = 0  # MoE: experts the router scores
    cp: int = 1  # context parallelism: tokens hold seq/cp positions of each sequence, attending to all seq


def gemm_seconds(g: Gemm, cl: Cluster, dtype: str) -> float:
    """One GEMM (or `batch` of them) on a GPU: the best cuBLAS tile, in waves over the SMs, at the
    sustained share of the peak, and never faster than HBM can stream its operands."""
    elt = 2 if dtype == "bf16" else 4
    per_sm = cl.peak_flops[dtype] / cl.sms * cl.gemm_efficiency
    best = math.inf
    for tm, tn in TILES:
        tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        feed = tm * tn / (tm + tn)  # MACs per operand element loaded
        rate = per_sm * (min(1.0, feed / cl.gemm_tile_feed) if cl.gemm_tile_feed else 1.0)
        best = min(best, math.ceil(tiles / cl.sms) * 2 * tm * tn * (g.k + cl.gemm_k_overhead) / rate)
    traffic = (g.m * g.k + g.k * g.n + g.m * g.n) * elt * g.batch
    return max(best, traffic / (cl.mem_bandwidth * cl.hbm_efficiency))


def op_seconds(op, cl: Cluster, dtype: str) -> float:
    if isinstance(op, Gemm):
        return gemm_seconds(op, cl, dtype)
    if isinstance(op, Stream):
        return op.nbytes / (cl.mem_bandwidth * cl.hbm_efficiency)
    eff = cl.attention_efficiency[1 if op.backward else 0]
    return op.flops / (cl.peak_flops[dtype] * eff)


# ---- the ops of one block ------------------------------------------------------------------

def block_forward(s: Shape) -> tuple[list, list]:
    """(the block's forward ops outside the attention core, the attention core's) for one micro-batch."""
    t, tn, d, r, a = s.tokens, s.sp_tokens, s.d_model, s.resid, s.act
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    cast_in = (r + a) * d * t if s.cast else 0.0  # autocast casts a linear's fp32 input
    ops: list = [Stream(2 * r * d * tn), Stream(3 * cast_in),  # attention norm; q, k, v inputs cast
                 Gemm(t, q, d), Gemm(t, kv, d), Gemm(t, kv, d)]
    core = attention_core(s)
    ops += [Stream(2 * a * q * t), Gemm(t, d, q), Stream((2 * r + a) * d * tn),  # y transposed; wo; residual
            Stream(2 * r * d * tn)]  # MLP norm
    if s.experts:
        ops += moe_ops(s)
    else:
        f = s.ffn
        ops += [Stream((s.mlp_matrices - 1) * cast_in)]
        ops += [Gemm(t, f, d)] * (s.mlp_matrices - 1)
        ops += [Stream((5 if s.mlp_matrices == 3 else 2) * a * f * t), Gemm(t, d, f)]  # silu(g) * u (or GELU)
    ops.append(Stream((2 * r + a) * d * tn))  # residual
    if s.cast:
        ops.append(Stream(CAST_BYTES * block_weights(s)))
    return ops, core


def attention_core(s: Shape) -> list:
    """Rotary on q and k, the kv heads repeated for grouped-query attention, and the attention."""
    t, a, hd = s.tokens, s.act, s.head_dim
    mb, q_len = t * s.cp // s.seq, s.seq // s.cp  # under cp a rank's queries see the whole sequence
    ops: list = [Stream(ROTARY_BYTES * (s.heads + s.kv_heads) * hd * t)]
    if s.kv_heads < s.heads:  # repeat_interleave writes whole k and v
        ops.append(Stream(2 * a * (s.heads + s.kv_heads) * hd * t))
    if s.fused:
        ops.append(FusedAttention(2 * mb * s.heads * q_len * s.seq * hd))  # 4 T^2 hd per head, halved by causality
    else:
        squares = mb * s.heads * q_len * s.seq
        ops += [Gemm(q_len, s.seq, hd, mb * s.heads), Stream((3 * a + 1) * squares),  # scores; mask + softmax
                Gemm(q_len, hd, s.seq, mb * s.heads)]
    return ops


def moe_ops(s: Shape) -> list:
    """An MoE feed-forward (tessel.models.moe): router, dispatch, the local experts, combine."""
    t, d, a, f = s.tokens, s.d_model, s.act, s.ffn
    rows = s.experts * s.expert_rows  # rows this rank's experts compute
    ops: list = [Gemm(t, s.router, d), Stream(4 * 4 * t * s.router), Stream(4 * a * d * rows)]  # router; permutes
    ops += [Gemm(s.expert_rows, f, d, s.experts)] * (s.mlp_matrices - 1)
    ops += [Stream((5 if s.mlp_matrices == 3 else 2) * a * f * rows), Gemm(s.expert_rows, d, f, s.experts)]
    return ops


def block_weights(s: Shape) -> float:
    """Matrix parameters of the block on this rank (what autocast casts and what gets a weight gradient)."""
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    mlp = s.mlp_matrices * s.d_model * s.ffn * (s.experts or 1)
    return s.d_model * (2 * q + 2 * kv) + mlp + (s.d_model * s.router if s.experts else 0)


def backward(ops: list) -> list:
    """Each GEMM's input and weight gradients; memory-bound ops at twice their forward traffic;
    fused attention's backward kernel."""
    out: list = []
    for op in ops:
        if isinstance(op, Gemm):
            out += [Gemm(op.m, op.k, op.n, op.batch), Gemm(op.n, op.k, op.m, op.batch)]
        elif isinstance(op, Stream):
            out.append(Stream(2 * op.nbytes))
        else:
            out.append(FusedAttention(FA_BWD_MATMULS * op.flops, backward=True))
    return out


def grad_accumulation(weights: float, s: Shape) -> Stream:
    """Weight gradients into their fp32 .grad: bf16 -> fp32 (under autocast), then added in place."""
    return Stream(weights * ((s.act + 4 if s.cast else 0) + 3 * (4 if s.resid == 4 else 2)))


def head_ops(s: Shape, vocab: int) -> tuple[list, list]:
    """(forward, backward) of the final norm, the vocab-parallel head (vocab / tp columns) and the loss."""
    t, tn, d, r, a = s.tokens, s.sp_tokens, s.d_model, s.resid, s.act
    logits = vocab * t
    cast = (r + a) * d * t if s.cast else 0.0
    fwd: list = [Stream(2 * r * d * tn), Stream(cast), Gemm(t, vocab, d),
                 Stream((a + 4 + 16) * logits)]  # logits to fp32; max, exp, sum, log over them
    if s.cast:
        fwd.append(Stream(CAST_BYTES * vocab * d))
    bwd = [Stream((8 + 4 + a) * logits)] + backward([Gemm(t, vocab, d)]) + [Stream(4 * r * d * tn)]
    return fwd, bwd + [grad_accumulation(vocab * d, s)]


def embedding_ops(s: Shape, vocab: int) -> tuple[list, list]:
    """(forward, backward) of the token embedding: a gather, then a dense gradient of vocab/tp rows."""
    rows = s.tokens * s.d_model
    return [Stream(2 * s.resid * rows)], [Stream(8 * rows + 3 * 4 * vocab * s.d_model)]


def block_seconds(s: Shape, cl: Cluster, dtype: str) -> tuple[float, float, float]:
    """(forward, backward, attention core forward) seconds of one block for one micro-batch."""
    fwd, core = block_forward(s)
    f = sum(op_seconds(op, cl, dtype) for op in fwd)
    c = sum(op_seconds(op, cl, dtype) for op in core)
    b = sum(op_seconds(op, cl, dtype) for op in backward(fwd + core))
    b += op_seconds(grad_accumulation(block_weights(s), s), cl, dtype)
    return f + c, b, c


def edge_seconds(s: Shape, vocab: int, cl: Cluster, dtype: str, first: bool, last: bool) -> tuple[float, float]:
    """(forward, backward) seconds of the embedding (first chunk) and the head and loss (last chunk);
    `vocab`: the rows of the vocabulary on this tp rank."""
    f = b = 0.0
    for on, (fw, bw) in ((first, embedding_ops(s, vocab)), (last, head_ops(s, vocab))):
        if on:
            f += sum(op_seconds(op, cl, dtype) for op in fw)
            b += sum(op_seconds(op, cl, dtype) for op in bw)
    return f, b
