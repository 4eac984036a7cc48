"""Memory formulas of the cost model: what one block keeps for backward, and ZeRO's shards.

tessel.planner.cost adds them up per device (with the collectives' workspace
the probe measures); these are the per-block and per-stage pieces.
"""

from __future__ import annotations

from tessel.planner.model_spec import ModelSpec


def layer_activation_bytes(spec: ModelSpec, tokens: int, tp: int, sp: bool, precision: str,
                           moe: bool = False) -> float:
    """Bytes one block keeps for backward, for `tokens` tokens (Korthikanti et al. 2022, redone for this block).

    Counted from tessel.models.gpt.Block: the residual input and the normed
    input of each sublayer (4 d, kept in fp32, replicated across tp unless
    sequence parallel); q, k, v before and after rotary, the attention output
    and the wo input (4 d + 3 d_kv), the SwiGLU gate, silu(gate), up and their
    product (4 ffn), and the attention's log-sum-exp (n_head floats); these
    are split by tp. Under bf16 autocast the matmul inputs are also kept as
    bf16 copies (2 d).
    An MoE block (tessel.models.moe) keeps, instead of the SwiGLU's 4 ffn, the
    same 4 ffn for each of a token's top_k expert rows, the dispatched rows and
    the expert outputs before combining (2 d each per row) and the router's
    fp32 probabilities (n_experts); tp leaves the MoE feed-forward replicated.
    """
    c = spec.cfg
    a = 2 if precision == "bf16" else 4
    d_kv = c.kv_heads * spec.head_dim
    replicated = 4 * c.d_model * 4 + (2 * c.d_model * 2 if precision == "bf16" else 0)
    split = (4 * c.d_model + 3 * d_kv + (0 if moe else 4 * c.ffn_dim)) * a + c.n_head * 4
    per_token = replicated / (tp if sp else 1) + split / tp
    if moe:
        per_token += c.moe_top_k * (4 * c.ffn_dim + 2 * c.d_model) * a + c.n_experts * 4
    return tokens * per_token


def recompute_layer_bytes(spec: ModelSpec, tokens: int, tp: int, sp: bool) -> float:
    """Full-layer recomputation keeps only each block's fp32 input (split by tp under SP)."""
    return tokens * spec.cfg.d_model * 4 / (tp if sp else 1)


def head_activation_bytes(spec: ModelSpec, tokens: int, tp: int, precision: str) -> float:
    """Logits, their fp32 copy and the saved log-softmax (vocab split by tp), plus the final norm."""
    a = 2 if precision == "bf16" else 4
    return tokens * (spec.cfg.vocab_size * (a + 8) / tp + 2 * spec.cfg.d_model * 4)


def zero_shards(stage: int, group: int) -> tuple[int, int, int]:
    """(params, grads, optimizer) divisors under ZeRO stage 0-3 (Rajbhandari et al. 2020)."""
    return (group if stage >= 3 else 1, group if stage >= 2 else 1, group if stage >= 1 else 1)
