"""tessel's reference GPT as a Hugging Face `LlamaForCausalLM`, and the names transformers' files may use.

(The names: hf_naming says what from_pretrained also accepts besides the model's own, and
converted_by_transformers hands files that need transformers' own conversions, such as Mixtral's
per-expert tensors, to its from_pretrained.)

The reference GPT (tessel.models.gpt) is a Llama in all but names and one
convention: RMSNorm, rotary attention with grouped KV heads, a SwiGLU MLP, no
biases. What differs:

- Rotary pairs. The GPT rotates interleaved pairs (x[2i], x[2i+1]) by angle i
  (the RoFormer paper's layout, Su et al. 2021, eq. 34); Llama's `rotate_half`
  rotates (x[i], x[i + hd/2]). Permuting the rows of each q and k head so that
  row i takes old row 2i and row hd/2 + i old row 2i+1 maps one onto the other:
  rope_hf(P q) = P rope_gpt(q), and P is orthogonal, so every score
  q . k = (P q) . (P k) is unchanged. v and o keep their rows.
- Names: tok_emb -> model.embed_tokens, attn.wq/wk/wv/wo -> self_attn.q/k/v/o_proj,
  attn_norm/mlp_norm -> input_layernorm/post_attention_layernorm,
  mlp.w_gate/w_up/w_down -> mlp.gate/up/down_proj, norm -> model.norm.
- The config: rms_norm_eps is the GPT's norm_eps (nn.RMSNorm and LlamaRMSNorm
  compute x / sqrt(mean(x^2) + eps) * w alike), rope_theta, head_dim and
  tie_word_embeddings carried over.

A GPT with mixture-of-experts blocks has no Llama counterpart (its routing
drops tokens past capacity; Mixtral's does not) and is refused.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn as nn

from tessel.config import ModelConfig
from tessel.hf.shape import config_file
from tessel.models.weights import INDEX, Naming, WeightsError, stored_shapes, weight_files

LLAMA_NAMES = {  # the GPT's per-layer names -> Llama's
    "attn_norm.weight": "input_layernorm.weight",
    "attn.wq.weight": "self_attn.q_proj.weight",
    "attn.wk.weight": "self_attn.k_proj.weight",
    "attn.wv.weight": "self_attn.v_proj.weight",
    "attn.wo.weight": "self_attn.o_proj.weight",
    "mlp_norm.weight": "post_attention_layernorm.weight",
    "mlp.w_gate.weight": "mlp.gate_proj.weight",
    "mlp.w_up.weight": "mlp.up_proj.weight",
    "mlp.w_down.weight": "mlp.down_proj.weight",
}


class NotConvertible(ValueError):
    """The model has no exact counterpart in the target format; the message says why."""


def llama_config(m: ModelConfig) -> dict:
    """The keyword arguments of transformers' LlamaConfig for the reference GPT `m`."""
    if m.hf_config is not None:
        raise NotConvertible("the model is already a Hugging Face model; it exports under its own names")
    if m.n_experts:
        raise NotConvertible(f"the reference GPT with mixture-of-experts blocks (model.n_experts = {m.n_experts}) "
                             "has no Llama counterpart: its capacity-limited routing drops tokens")
    if m.sliding_window is not None and m.sliding_window < m.max_seq_len:
        raise NotConvertible(f"the reference GPT attends within a window (model.sliding_window = {m.sliding_window}); "
                             "Llama attends to every earlier token")
    return dict(vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.ffn_dim,
                num_hidden_layers=m.n_layer, num_attention_heads=m.n_head, num_key_value_heads=m.kv_heads,
                head_dim=m.d_model // m.n_head, max_position_embeddings=m.max_seq_len, rms_norm_eps=m.norm_eps,
                rope_theta=m.rope_theta, tie_word_embeddings=m.tie_embeddings, hidden_act="silu",
                attention_bias=False, mlp_bias=False, attention_dropout=0.0,
                architectures=["LlamaForCausalLM"], model_type="llama")


def rotate_half_rows(w: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of a q or k projection (heads * head_dim, d), each head's interleaved rotary pairs
    (2i, 2i+1) regrouped as halves (i, hd/2 + i)."""
    rows, d = w.shape
    return w.reshape(rows // head_dim, head_dim // 2, 2, d).transpose(1, 2).reshape(rows, d)


def gpt_to_llama(state: dict[str, torch.Tensor], m: ModelConfig) -> dict[str, torch.Tensor]:
    """The reference GPT's tensors (its own names) as LlamaForCausalLM's; the head is left out when tied."""
    llama_config(m)  # refuses what does not convert
    hd = m.d_model // m.n_head
    out = {"model.embed_tokens.weight": state["tok_emb.weight"], "model.norm.weight": state["norm.weight"]}
    if not m.tie_embeddings:
        out["lm_head.weight"] = state["lm_head.weight"]
    for i in range(m.n_layer):
        for ours, theirs in LLAMA_NAMES.items():
            t = state[f"layers.{i}.{ours}"]
            if ours in ("attn.wq.weight", "attn.wk.weight"):
                t = rotate_half_rows(t, hd)
            out[f"model.layers.{i}.{theirs}"] = t
    return out


def converted_by_transformers(hf_config: str, weights: str) -> dict[str, torch.Tensor]:
    """The model's own state from weights saved under names transformers converts while loading (Mixtral's
    per-expert w1/w2/w3 that v5 fuses into stacked experts, renamed keys of older checkpoints): its
    from_pretrained reads a scratch folder of the config and links to the files, on the CPU.
    WeightsError naming what it found missing, unexpected or misshapen."""
    from transformers import AutoModelForCausalLM  # deferred: transformers loads in seconds
    from transformers.utils import logging  # deferred: as above
    logging.set_verbosity_error()  # its load report and progress bars: the error below says what matters
    logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="tessel-weights-") as scratch:
        folder = Path(scratch)
        shutil.copyfile(config_file(hf_config), folder / "config.json")
        weight_map = {}
        for i, f in enumerate(weight_files(weights)):  # an index of our own: any file names, sharded or not
            link = folder / f"part-{i:05d}.safetensors"
            link.symlink_to(f.absolute())
            weight_map.update(dict.fromkeys(stored_shapes(f), link.name))
        (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        try:
            model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
        except (OSError, ValueError, RuntimeError, KeyError) as err:
            raise WeightsError(f"transformers could not read them ({type(err).__name__}: {err})") from None
    problems = {k: sorted(map(str, info.get(k) or ())) for k in ("missing_keys", "unexpected_keys",
                                                                  "mismatched_keys")}
    if any(problems.values()):
        raise WeightsError("; ".join(f"{k.replace('_keys', '')} {', '.join(v[:4])}" for k, v in problems.items() if v))
    return model.state_dict()


def hf_naming(model: nn.Module) -> Naming:
    """The names from_pretrained would also accept for a transformers model: without the base model's
    prefix, and the stale buffers its class lists as ignorable (GPT-2's attn.bias)."""
    from transformers import PreTrainedModel  # deferred: transformers loads in seconds
    if not isinstance(model, PreTrainedModel):
        return Naming()
    # from_pretrained's own list of names a file may hold that the class no longer has
    ignore = tuple(model._keys_to_ignore_on_load_unexpected or ())
    return Naming(prefix=model.base_model_prefix, ignore=ignore)
