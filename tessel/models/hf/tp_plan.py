"""How tensor parallelism splits a Hugging Face family: data, and transformers' own plan mapped onto tessel's.

transformers declares, for most families, which linear layers of the base
model are column- and row-parallel: `config.base_model_tp_plan`, module
patterns under the base model ("layers.*.self_attn.q_proj" -> "colwise").
tessel reads it from the model's own config and maps it onto its styles
(tessel.parallel.tensor.tensor_parallel.STYLES), then adds what that plan
leaves to transformers' runtime:

- "enter" on the module around each group of column-parallel layers (the
  attention, the MLP): one Megatron f, or one sequence all-gather, shared by q,
  k and v, or by gate and up;
- the vocabulary-parallel embedding, whose output stays whole (the model reads
  its positions and causal mask from it), and the vocabulary-parallel head,
  whose logits stay split for tessel's vocab-parallel loss (transformers'
  "colwise_gather_output" would gather them);
- the norms that run on sequence shards under sequence parallelism, the first
  decoder layer, where the sequence is split, and the final norm, whose output
  is the whole sequence again (the model reshapes it to its input's shape:
  GPT-2) and enters the head's region;
- modules computed whole on every tp rank ("replicate": an MoE block, whose
  experts go to the ep axis) or left whole ("keep": GPT-2's position embedding).

A family whose config has no base_model_tp_plan (GPT-2) brings rules for its
linear layers here, keyed by module names: its Conv1D layers (weight [in, out])
and its fused q|k|v projection, split per head ("colwise_qkv"). This file must
not import tessel.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch.nn as nn

# transformers' styles for linear layers -> tessel's (the attention's and MLP's projections)
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise"}
COLUMN = ("colwise", "colwise_qkv")  # styles whose enclosing module enters the region


@dataclass(frozen=True)
class TPRules:
    """A family's tensor-parallel rules: module name patterns (fnmatch, whole name)."""
    embedding: str  # the token embedding: vocabulary-parallel, whole output
    first_layer: str  # where the sequence is split under sequence parallelism
    norms: tuple[str, ...]  # in the decoder layers: run on sequence shards under sequence parallelism
    final_norm: str  # the last norm: sequence shards in, the whole sequence out, into the head's region
    head: str = "lm_head"  # vocabulary-parallel (entered at final_norm); tied to the embedding if the model ties them
    linear: tuple[tuple[str, str], ...] = ()  # pattern -> style, where the config has no base_model_tp_plan
    replicated: tuple[str, ...] = ()  # computed whole on every tp rank (MoE blocks)
    kept: tuple[str, ...] = ()  # parameters left whole outside the split region (position embeddings)
    widths: tuple[tuple[str, tuple[str, ...]], ...] = ()  # pattern -> attributes holding a width tp divides
    # the base model reshapes its final norm's output to its input's (B, T) (GPT-2): under sequence parallelism
    # a pipeline stage before the last makes the sequence whole there and sends its own shard
    reshapes_output: bool = False


LLAMA_TP = TPRules(  # also Mistral and Qwen2: the same module names
    embedding="model.embed_tokens", first_layer="model.layers.0",
    norms=("model.layers.*.input_layernorm", "model.layers.*.post_attention_layernorm"), final_norm="model.norm")
MIXTRAL_TP = replace(LLAMA_TP, replicated=("model.layers.*.mlp",))  # the sparse MoE block: experts on ep
GPT2_TP = TPRules(
    embedding="transformer.wte", first_layer="transformer.h.0",
    norms=("transformer.h.*.ln_1", "transformer.h.*.ln_2"), final_norm="transformer.ln_f",
    linear=(("transformer.h.*.attn.c_attn", "colwise_qkv"), ("transformer.h.*.attn.c_proj", "rowwise"),
            ("transformer.h.*.mlp.c_fc", "colwise"), ("transformer.h.*.mlp.c_proj", "rowwise")),
    kept=("transformer.wpe",),
    widths=(("transformer.h.*.attn", ("split_size",)),),  # it splits c_attn's output at the whole width
    reshapes_output=True)


@dataclass(frozen=True)
class TPPlan:
    """What tessel.parallel.tensor.tensor_parallel.apply_plan takes."""
    styles: dict[str, str]  # module pattern -> style
    widths: dict[str, tuple[str, ...]]  # module pattern -> attributes divided by tp


def hf_tp_plan(model: nn.Module, rules: TPRules | None) -> TPPlan:
    """The plan for a transformers causal LM: its config's base_model_tp_plan (or the family's own
    linear rules) with the family's embedding, head, norms and replicated modules.

    rules None (an architecture tessel has no rules for): only what transformers' plan says, so that
    apply_plan(place_all=True) names the first module nobody placed.
    """
    linear = _linear_styles(model, rules)
    styles = {_parent(pattern): "enter" for pattern, style in linear.items() if style in COLUMN}
    if rules is not None:
        styles.update({rules.embedding: "vocab_embedding_whole", rules.first_layer: "split_sequence"})
        styles.update({pattern: "sequence_norm" for pattern in rules.norms})
        styles[rules.final_norm] = "final_norm"
        styles.update({pattern: "replicate" for pattern in rules.replicated})
        styles.update({pattern: "keep" for pattern in rules.kept})
    styles.update(linear)
    if rules is not None:
        styles[rules.head] = "vocab_head_entered"
    return TPPlan(styles, dict(rules.widths) if rules is not None else {})


def _linear_styles(model: nn.Module, rules: TPRules | None) -> dict[str, str]:
    """Pattern -> tessel style for the linear layers, from transformers' plan when the config has one."""
    # deferred: transformers takes seconds to import; only Hugging Face models reach this line
    from transformers import PreTrainedModel
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"a {type(model).__name__} is not a transformers model")
    theirs = model.config.base_model_tp_plan
    if not theirs:
        return dict(rules.linear) if rules is not None else {}
    replicated = rules.replicated if rules is not None else ()
    out = {}
    for key, style in theirs.items():
        pattern = f"{model.base_model_prefix}.{key}"
        if any(pattern == r or pattern.startswith(r + ".") for r in replicated):
            continue  # inside a module every tp rank computes whole
        if style not in HF_STYLES:
            raise ValueError(f"transformers' tensor-parallel plan asks {style!r} of {pattern!r}, "
                             f"which tessel does not map (it maps {sorted(HF_STYLES)})")
        out[pattern] = HF_STYLES[style]
    return out


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]
