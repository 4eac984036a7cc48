"""Compute as a roofline per op: the kernels one block runs, and how long each takes on a GPU preset.

A block of tessel's GPT (tessel.models.gpt.Block) forward is a list of ops,
read off its code as one tp rank runs it under bf16 autocast:

- GEMMs, (M, N, K) per call: the q, k, v, output and MLP projections (and the
  head, the router and the experts), each priced by tessel.planner.gemm: a
  roofline of tiles in waves over the SMs, split-K where the waves would be
  empty, HBM's floor, corrected by the GPU's measured table where one exists.
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

Compiled blocks (train.compile = "blocks" or "model", `Shape.compiled`):
inductor fuses each chain of memory-bound ops between two GEMMs (or the
attention kernel) into one kernel that reads its inputs and writes its outputs
once: a norm with the cast of its output (the q, k, v projections share one
cast), the residual add with the next norm, rotary with the kv heads' repeat,
SiLU with its product. The GEMMs and the attention kernel are unchanged, and
nothing fuses across blocks (each is its own graph). Backward keeps the
forward's rule (about twice its traffic).

The fused loss (train.fused_loss, `Shape.fused_loss`): the head's GEMM and the
cross-entropy run chunk by chunk over the tokens; each chunk's bf16 logits are
read once for the log-sum-exp and the gradient (softmax minus the target) is
written in the forward, as Liger Kernel's fused linear cross-entropy does
(Hsu et al. 2024), so the backward runs only the head's two gradient GEMMs.
No fp32 copy of the logits and no log-softmax pass exist
(tessel.planner.memory.head_activation_bytes counts what it holds).

Byte counts are per element of the tensors named; `r` is the residual stream's
element size (fp32 parameters keep it fp32 under autocast), `a` a bf16
activation's. The cost model sums these per chunk (tessel.planner.cost); on
"this" machine compute is measured instead (tessel.calibrate.profile).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tessel.parallel.fused_loss.chunks import chunk_tokens
from tessel.planner.cluster import Cluster
from tessel.planner.gemm import Gemm, gemm_seconds

ROTARY_BYTES = 24  # per element of q or k: read it, 6 fp32 elementwise ops on its halves, stack, cast back
CAST_BYTES = 6  # autocast's copy of an fp32 weight: read 4, write 2
FA_BWD_MATMULS = 2.5  # FlashAttention's backward runs 5 matmuls to the forward's 2 (it recomputes the scores)


@dataclass(frozen=True)
class Stream:
    """A memory-bound op: bytes read and written."""
    nbytes: float


@dataclass(frozen=True)
class Float8Gemm:
    """A block linear's GEMM under train.precision = "fp8" (tessel.parallel.float8): at the device's float8
    peak, plus its dynamic scaling, memory-bound: each high-precision operand read twice (its amax, then the
    cast) and written once in float8. cast_bytes: those bytes for this GEMM's operands."""
    gemm: Gemm
    cast_bytes: float


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
    compiled: bool = False  # torch.compile'd blocks: memory-bound chains fused (the module docstring)
    fused_loss: bool = False  # the head and cross-entropy fused and chunked: no fp32 logits
    shared_ffn: int = 0  # MoE: the shared experts' width per tp rank (DeepSeek's, Qwen2-MoE's), a SwiGLU
    # the attention's projections as (out, in) per tp rank where they are not q, k, v and o (multi-head latent
    # attention: tessel.hf.blocks.Attention.gemms); the last one is the output projection
    attn_gemms: tuple[tuple[int, int], ...] = ()
    fp8: bool = False  # train.precision = "fp8": the attention's and the dense MLP's GEMMs in float8


def op_seconds(op, cl: Cluster, dtype: str) -> float:
    if isinstance(op, Gemm):
        return gemm_seconds(op, cl, dtype)
    if isinstance(op, Float8Gemm):  # a device without a float8 peak is refused fp8 before it runs (bf16 here)
        fp8 = "fp8" if "fp8" in cl.peak_flops else dtype
        return gemm_seconds(op.gemm, cl, fp8) + op.cast_bytes / (cl.mem_bandwidth * cl.hbm_efficiency)
    if isinstance(op, Stream):
        return op.nbytes / (cl.mem_bandwidth * cl.hbm_efficiency)
    eff = cl.attention_efficiency[1 if op.backward else 0]
    return op.flops / (cl.peak_flops[dtype] * eff)


# ---- the ops of one block ------------------------------------------------------------------

def block_forward(s: Shape) -> tuple[list, list]:
    """(the block's forward ops outside the attention core, the attention core's) for one micro-batch."""
    t, tn, d, r, a = s.tokens, s.sp_tokens, s.d_model, s.resid, s.act
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    into, out = attention_gemms(s)
    ops: list = norm_and_cast(s, 3) + [linear(s, t, n, k) for n, k in into]
    core = attention_core(s)
    ops += [Stream(2 * a * q * t), linear(s, t, *out)]  # y transposed; wo
    if s.compiled and tn == t:  # the residual add, the MLP norm and its cast in one kernel
        ops.append(Stream((2 * r + 2 * a) * d * tn))
    else:
        ops += [Stream((2 * r + a) * d * tn)] + norm_and_cast(s, 0 if s.experts else s.mlp_matrices - 1)
    if s.experts:
        ops += moe_ops(s) + shared_expert_ops(s)
    else:
        f = s.ffn
        ops += [linear(s, t, f, d)] * (s.mlp_matrices - 1)
        ops += [Stream(activation_bytes(s) * a * f * t), linear(s, t, d, f)]  # silu(g) * u (or GELU)
    ops.append(Stream((2 * r + a) * d * tn))  # residual
    if s.cast:
        ops.append(Stream(CAST_BYTES * block_weights(s)))
    return ops, core


def linear(s: Shape, m: int, n: int, k: int):
    """A block linear layer's forward GEMM (m tokens, n outputs, k inputs): in float8 under fp8 where its
    dimensions allow (multiples of 16, as tessel.parallel.float8 requires); the casts of its input (act bytes)
    and of its fp32 weight, each read twice and written once in float8."""
    if not s.fp8 or n % 16 or k % 16:
        return Gemm(m, n, k)
    return Float8Gemm(Gemm(m, n, k), (2 * s.act + 1) * m * k + (2 * 4 + 1) * n * k)


def attention_gemms(s: Shape) -> tuple[list[tuple[int, int]], tuple[int, int]]:
    """((out, in) of the projections into the attention, (out, in) of the one out of it): q, k, v and o, or a
    latent attention's own (Shape.attn_gemms)."""
    if s.attn_gemms:
        return list(s.attn_gemms[:-1]), s.attn_gemms[-1]
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    return [(q, s.d_model), (kv, s.d_model), (kv, s.d_model)], (s.d_model, q)


def shared_expert_ops(s: Shape) -> list:
    """The shared experts beside an MoE block's routed ones: a SwiGLU of width shared_ffn on every token."""
    if not s.shared_ffn:
        return []
    t, f = s.tokens, s.shared_ffn
    return [Gemm(t, f, s.d_model)] * 2 + [Stream(activation_bytes(s) * s.act * f * t), Gemm(t, s.d_model, f)]


def norm_and_cast(s: Shape, users: int) -> list:
    """An RMSNorm and autocast's casts of its output for the `users` linears that read it. Eager: the norm
    writes the residual's dtype and each linear casts its own copy; compiled: one kernel writes the cast
    once (under SP the gather sits between them: the norm, then one cast of the gathered input)."""
    t, tn, d, r, a = s.tokens, s.sp_tokens, s.d_model, s.resid, s.act
    cast_in = (r + a) * d * t if s.cast else 0.0  # autocast casts a linear's fp32 input
    if not s.compiled:
        return [Stream(2 * r * d * tn), Stream(users * cast_in)]
    if tn == t:
        return [Stream((r + a) * d * tn)]
    return [Stream(2 * r * d * tn), Stream(min(users, 1) * cast_in)]


def activation_bytes(s: Shape) -> int:
    """Elements of the MLP's width read and written by its activation, per token: SwiGLU eager reads g,
    writes silu(g), reads it and u, writes the product (5); compiled reads g and u, writes once (3); GELU 2."""
    if s.mlp_matrices != 3:
        return 2
    return 3 if s.compiled else 5


def attention_core(s: Shape) -> list:
    """Rotary on q and k, the kv heads repeated for grouped-query attention, and the attention."""
    t, a, hd = s.tokens, s.act, s.head_dim
    mb, q_len = t * s.cp // s.seq, s.seq // s.cp  # under cp a rank's queries see the whole sequence
    if s.compiled:  # rotary reads and writes q and k once; k's repeat is written by the same kernel, v copied
        ops: list = [Stream(a * (4 * s.heads + 2 * s.kv_heads) * hd * t if s.kv_heads < s.heads
                            else 2 * a * (s.heads + s.kv_heads) * hd * t)]
    else:
        ops = [Stream(ROTARY_BYTES * (s.heads + s.kv_heads) * hd * t)]
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
    into, out = attention_gemms(s)
    attention = sum(n * k for n, k in into) + out[0] * out[1]
    mlp = s.mlp_matrices * s.d_model * s.ffn * (s.experts or 1) + 3 * s.d_model * s.shared_ffn
    return attention + mlp + (s.d_model * s.router if s.experts else 0)


def backward(ops: list) -> list:
    """Each GEMM's input and weight gradients; memory-bound ops at twice their forward traffic;
    fused attention's backward kernel."""
    out: list = []
    for op in ops:
        if isinstance(op, Gemm):
            out += [Gemm(op.m, op.k, op.n, op.batch), Gemm(op.n, op.k, op.m, op.batch)]
        elif isinstance(op, Float8Gemm):  # the output's gradient cast for each product, the input and weight again
            g, dy = op.gemm, (2 * 2 + 1) * op.gemm.m * op.gemm.n
            out += [Float8Gemm(Gemm(g.m, g.k, g.n), dy + 9 * g.n * g.k),
                    Float8Gemm(Gemm(g.n, g.k, g.m), dy + op.cast_bytes - 9 * g.n * g.k)]
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
    if s.fused_loss:  # each chunk's logits read once; their gradient written in the forward (module docstring)
        # and each chunk adds its weight-gradient product into one fp32 sum: read and written once per chunk
        # (a bf16 product is written and read besides), the traffic that bounds the kernel's chunk count
        chunks = math.ceil(t / chunk_tokens(int(t), d, int(vocab)))
        loss_fwd = Stream(2 * a * logits + chunks * (8 + (2 * a if a == 2 else 0)) * vocab * d)
        loss_bwd = Stream(0.0)
    else:  # logits to fp32; max, exp, sum, log over them; backward: softmax - onehot, cast back
        loss_fwd, loss_bwd = Stream((a + 4 + 16) * logits), Stream((8 + 4 + a) * logits)
    fwd: list = [Stream(2 * r * d * tn), Stream(cast), Gemm(t, vocab, d), loss_fwd]
    if s.cast:
        fwd.append(Stream(CAST_BYTES * vocab * d))
    bwd = [loss_bwd] + backward([Gemm(t, vocab, d)]) + [Stream(4 * r * d * tn)]
    return fwd, bwd + [grad_accumulation(vocab * d, s)]


def step_gemms(s: Shape, vocab: int) -> list[Gemm]:
    """Every distinct GEMM one micro-batch runs through a block and the head (forward and backward): the
    shapes benchmarks/gpu_suite.py times to ground tessel.planner.gemm's table."""
    fwd, core = block_forward(s)
    head_fwd, head_bwd = head_ops(s, vocab)
    ops = fwd + core + backward(fwd + core) + head_fwd + head_bwd
    return list(dict.fromkeys(op for op in ops if isinstance(op, Gemm)))


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
