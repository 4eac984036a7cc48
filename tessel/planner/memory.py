"""Memory formulas of the cost model: what one block keeps for backward, and ZeRO's shards.

The pricers (tessel.planner.pricing.zero, .recompute) add them up per device (with the collectives' workspace
the probe measures); these are the per-block and per-stage pieces.
"""

from __future__ import annotations

import math

from tessel.config import compute_bytes, compute_dtype
from tessel.parallel.fused_loss.chunks import chunk_tokens
from tessel.planner.model_spec import ModelSpec


def layer_activation_bytes(spec: ModelSpec, tokens: int, tp: int, sp: bool, precision: str,
                           moe: bool = False) -> float:
    """Bytes one block keeps for backward, for `tokens` tokens (Korthikanti et al. 2022, redone for this block).

    Counted from what autograd saves in tessel.models.gpt.Block (tests/planner/test_activation_memory.py
    measures it), a bytes per activation element (2 under bf16 autocast, else 4):
    - the residual stream, fp32: each norm keeps its input, its normalised x/rms (4 d) and the
      rms (2 floats); split by tp under sequence parallelism, else replicated;
    - the inputs of the column-parallel matmuls: under bf16 autocast a bf16 copy per matmul (wq, wk,
      wv, SwiGLU's gate and up: 5 d), in fp32 the normed input itself (2 d). Whole on every tp rank,
      sequence parallel or not: tessel's SP all-gathers the normed input before the matmuls save it;
    - attention, split by tp: what the attention kernel saves (rotated q, rotated k and v as wide as
      q once kv heads are repeated or when there are as many, its output and log-sum-exp) and the
      wo input: 5 q + n_head floats; q and k before rotary are not kept (rotary keeps its tables);
    - the SwiGLU's gate, silu(gate), up and their product (4 ffn), split by tp.
    An MoE block (tessel.models.moe) keeps, instead of the SwiGLU's terms, the router's input and
    for each of a token's top_k expert rows the same 4 ffn, the dispatched row and the expert output
    (2 d), and the router's fp32 probabilities (n_experts); tp leaves the MoE feed-forward replicated. Shared
    experts (DeepSeek's, Qwen2-MoE's) keep a SwiGLU's 4 terms of their width, split by tp.
    """
    c = spec.cfg
    a = compute_bytes(precision)
    q = c.n_head * spec.head_dim
    stream = 4 * c.d_model * 4 + 2 * 4
    casts = (3 + (1 if moe else 2)) * c.d_model * 2 if compute_dtype(precision) == "bf16" else 2 * c.d_model * 4
    split = (5 * q + (4 * spec.shared_ffn if moe else 4 * c.ffn_dim)) * a + c.n_head * 4
    per_token = stream / (tp if sp else 1) + casts + split / tp
    if moe:
        per_token += spec.moe_top_k * (4 * spec.expert_ffn + 2 * c.d_model) * a + spec.n_experts * 4
    return tokens * per_token


def attention_core_bytes(spec: ModelSpec, tokens: int, tp: int, precision: str, fused: bool = True) -> float:
    """What selective recompute (Korthikanti et al. 2022; tessel.parallel.recompute) saves of one block:
    the core's saved tensors (rotated q, k and v as the kernel sees them, its output, the log-sum-exp:
    4 q + n_head floats of layer_activation_bytes' terms) less its inputs, which the recomputed
    region keeps instead (q, k, v before rotary: q + 2 kv); without a fused kernel also the T x T
    probabilities of every head (the 2 a s^2 b / t term of the paper's 5 a s^2 b / t, which without
    dropout is all of it that is saved)."""
    c = spec.cfg
    a = compute_bytes(precision)
    q, kv = c.n_head * spec.head_dim, c.kv_heads * spec.head_dim
    per_token = (3 * q - 2 * kv) * a + c.n_head * 4
    if not fused:
        per_token += a * c.n_head * spec.seq_len
    return tokens * per_token / tp


def unfused_attention_bytes(spec: ModelSpec, tokens: int, tp: int, precision: str) -> float:
    """The T x T softmax probabilities an unfused attention keeps per block (a bytes per head and key)."""
    a = compute_bytes(precision)
    return tokens * a * spec.cfg.n_head * spec.seq_len / tp


def recompute_layer_bytes(spec: ModelSpec, tokens: int, tp: int, sp: bool) -> float:
    """Full-layer recomputation keeps only each block's fp32 input (split by tp under SP)."""
    return tokens * spec.cfg.d_model * 4 / (tp if sp else 1)


def head_activation_bytes(spec: ModelSpec, tokens: int, tp: int, precision: str, fused_loss: bool = False) -> float:
    """Logits, their fp32 copy and the saved log-softmax (vocab split by tp), plus the final norm.

    A fused loss (train.fused_loss) holds one chunk of tokens' logits at a time (the kernel's own rule,
    tessel.parallel.fused_loss.chunks), with their
    fp32 log-sum-exp pass and their gradient, and keeps until the backward what its forward computed: the
    gradient of the hidden states (tokens x d) and the head's fp32 weight gradient (Liger Kernel's
    fused linear cross-entropy, Hsu et al. 2024; tessel.planner.compute says what it runs).
    """
    a = compute_bytes(precision)
    c = spec.cfg
    norm = tokens * 2 * c.d_model * 4
    if not fused_loss:
        return tokens * c.vocab_size * (a + 8) / tp + norm
    rows = math.ceil(c.vocab_size / tp)
    chunk = chunk_tokens(int(tokens), c.d_model, rows) * rows * (a + 4 + a)
    return chunk + tokens * c.d_model * a + 4 * c.vocab_size * c.d_model / tp + norm


def zero_shards(stage: int, group: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) divisors under ZeRO stage 0-3 (Rajbhandari et al. 2020)."""
    return (group if stage >= 3 else 1, group if stage >= 2 else 1, group if stage >= 1 else 1)


def zero_state_bytes(params: float, stage: int, group: int, param_bytes: int = 4, reduce_bytes: int = 4,
                     whole_grads: bool = False) -> dict[str, float]:
    """Bytes of `params` parameters' training state on one rank under ZeRO `stage` over `group` ranks.

    Mixed precision as the ZeRO paper counts it (Rajbhandari et al. 2020, sec. 3.1): parameters and
    gradients in the compute dtype (2 bytes each in bf16) and K = 12 bytes of optimizer state (fp32
    master weights, Adam's momentum and variance); stage 1 divides the optimizer state over the
    group, stage 2 the gradients too, stage 3 the parameters too: 2 + 2 + 12/N, 2 + 14/N, 16/N.
    With fp32 storage (parallel.zero_param_dtype = "fp32", and always without ZeRO) the parameters
    are their own masters: 4 + 4 + 8/N (Adam's two moments).

    What tessel's runtime holds beyond that (tessel.parallel.zero.zero_parallel's table, checked
    against the real model by tests/testing/test_dryrun.py):
    "fp32_grads": its optimizer reads an fp32 gradient of the owned shard
    (tessel.parallel.zero.gradients): a view of the reduced buffer when that is fp32, a copy
    otherwise (stage 1: + 4/N); stages 2, 3 keep the reduced shard in fp32 (+ 2/N over the
    paper's bf16 shard). Stage 3 with low-precision storage keeps no bf16 shard: the fp32 master
    is the stored shard and each gather casts it (the gathered units are the cost model's
    buffers), so "params" is 0 there and the total equals the paper's 16/N.
    whole_grads: the gradients stay whole however the stage divides them (a pipeline accumulates
    them over the step, then reduce-scatters them into the owned fp32 shard, kept between steps).
    """
    zp, zg, zo = zero_shards(stage, group)
    if whole_grads:
        zg = 1
    masters = 4 if param_bytes != 4 else 0
    stored = 0 if stage >= 3 and masters else param_bytes  # stage 3 stores only the fp32 master shard
    out = {"params": stored * params / zp, "grads": reduce_bytes * params / zg,
           "optimizer": (8 + masters) * params / zo, "fp32_grads": 0.0}
    if stage >= 2 and whole_grads:  # the owned shard the whole buffer is reduce-scattered into
        out["fp32_grads"] = 4 * params / zo
    elif stage >= 2:  # the reduced shard is kept in fp32 whatever was reduced
        out["fp32_grads"] = (4 - reduce_bytes) * params / zo
    elif stage >= 1 and reduce_bytes != 4:  # stage 1: an fp32 copy of the owned part of the reduced buffer
        out["fp32_grads"] = 4 * params / zo
    return out
