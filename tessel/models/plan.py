"""How the reference GPT is split by tensor parallelism: data, not code.

Module name pattern (fnmatch, whole name) -> style; the first matching pattern
wins. tessel.parallel.tensor.tensor_parallel.STYLES says what each style does:

- enter: the module's input enters the tensor-parallel region once (Megatron's
  f; the sequence-parallel all-gather), shared by the column-parallel layers in it
- colwise / rowwise: ColumnParallelLinear / RowParallelLinear (Megatron)
- vocab_embedding / vocab_head: the vocabulary split over ranks, padded to a
  multiple of tp; the head's logits stay sharded for the vocab-parallel loss
- sequence_norm: under sequence parallelism the norm runs on 1/tp of the tokens
  and its weight gradient is summed over tp; otherwise left as it is

Attention splits its heads (q, k, v column-parallel, the output projection
row-parallel); the SwiGLU MLP splits gate and up column-parallel, down row-
parallel. This file must not import tessel.parallel.
"""

GPT_TP_PLAN: dict[str, str] = {
    "tok_emb": "vocab_embedding",
    "layers.*.attn_norm": "sequence_norm",
    "layers.*.attn": "enter",
    "layers.*.attn.w[qkv]": "colwise",
    "layers.*.attn.wo": "rowwise",
    "layers.*.mlp_norm": "sequence_norm",
    "layers.*.mlp": "enter",
    "layers.*.mlp.w_gate": "colwise",
    "layers.*.mlp.w_up": "colwise",
    "layers.*.mlp.w_down": "rowwise",
    "norm": "sequence_norm",
    "lm_head": "vocab_head",
}


def gpt_tp_plan(moe_blocks: list[int], n_layer: int) -> dict[str, str]:
    """GPT_TP_PLAN with the MoE blocks' feed-forward replicated over tp (first match wins).

    Experts are split over the ep axis, not tp; the MoE input is the same on every
    tp rank (under sequence parallelism once gathered), so each rank computes it whole.
    """
    plan = {f"layers.{i}.mlp": "replicate" for i in moe_blocks}
    # the dense feed-forward's own patterns; not mlp_norm, which MoE blocks keep (sequence_norm)
    dense = [k for k in GPT_TP_PLAN if k == "layers.*.mlp" or k.startswith("layers.*.mlp.")]
    for key, style in GPT_TP_PLAN.items():
        if key in dense and len(moe_blocks) == n_layer:
            continue  # no dense feed-forward left for these patterns to match
        plan[key] = style
    return plan
