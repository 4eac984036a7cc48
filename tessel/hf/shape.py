"""A Hugging Face config.json read as tessel's model shape, without transformers or torch.

It sits below tessel.config (which fills the model's shape fields from it) and tessel.models.

The config must check in a fraction of a second before any process starts
(`tessel train`, `tessel plan`), and importing transformers loads torch. So the
few fields tessel needs are read from the JSON itself, with the defaults the
families' configuration classes use where a key is absent
(transformers/models/<family>/configuration_<family>.py).

FAMILIES names the architectures of tessel's table (tessel.models.hf.families),
checked here without building anything; another whose config declares plans
is placed on tp and pp by the derivation from those plans (tessel.hf.layout,
which the checks run on the model built on the meta device), and any causal LM
trains under data parallelism, ZeRO and recompute.
"""

from __future__ import annotations

import json
from pathlib import Path

# model_type -> the family whose layout rules apply (tessel.models.hf.families): each with a parity test under
# tp, tp + SP, pp and dp x tp x pp (tests/parallel/tensor/test_hf_tensor_parallel.py, tests/parallel/pipeline/)
FAMILIES = {kind: kind for kind in (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "granite", "phi3", "gpt_neox",
    "starcoder2", "cohere", "mixtral", "gpt2")}
# families whose tp rules and pipeline parts tessel writes itself (tessel.models.hf.families): their configs
# declare no plans
OWN_RULES = ("gpt2",)
# tie_word_embeddings' default in the family's config class
TIED_BY_DEFAULT = {"gpt2", "gemma", "gemma2", "gemma3_text", "starcoder2", "cohere"}


class HFConfigError(ValueError):
    """The config cannot be read as a causal LM shape; the message names the key."""


def config_file(path: str | Path) -> Path:
    """A config.json, or the folder holding one (as from_pretrained takes it)."""
    path = Path(path)
    return path / "config.json" if path.is_dir() else path


def read_config(path: str | Path) -> dict:
    file = config_file(path)
    try:
        doc = json.loads(file.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise HFConfigError(f"no such file: {file}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise HFConfigError(f"{file} is not a JSON config ({err})") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise HFConfigError(f"{file} names no model_type")
    return doc


def _need(doc: dict, *keys: str):
    for key in keys:
        if doc.get(key) is not None:
            return doc[key]
    raise HFConfigError(f"the config has no {keys[0]}")


def _rope_theta(doc: dict) -> float:
    rope = doc.get("rope_parameters") or {}
    return float(rope.get("rope_theta") or doc.get("rope_theta") or 10000.0)


def model_shape(path: str | Path) -> dict:
    """tessel.config.ModelConfig's shape fields for the config at `path`."""
    doc = read_config(path)
    kind = doc["model_type"]
    if kind == "gpt2":
        d = int(_need(doc, "n_embd", "hidden_size"))
        shape = {"vocab_size": _need(doc, "vocab_size"), "n_layer": _need(doc, "n_layer", "num_hidden_layers"),
                 "n_head": _need(doc, "n_head", "num_attention_heads"), "d_model": d,
                 "d_ff": doc.get("n_inner") or 4 * d, "max_seq_len": _need(doc, "n_positions"),
                 "norm_eps": float(doc.get("layer_norm_epsilon", 1e-5))}
    else:
        heads = _need(doc, "num_attention_heads")
        shape = {"vocab_size": _need(doc, "vocab_size"), "n_layer": _need(doc, "num_hidden_layers"),
                 "n_head": heads, "n_kv_head": doc.get("num_key_value_heads") or heads,
                 "d_model": _need(doc, "hidden_size"), "d_ff": _need(doc, "intermediate_size"),
                 "max_seq_len": _need(doc, "max_position_embeddings"), "rope_theta": _rope_theta(doc),
                 "norm_eps": float(doc.get("rms_norm_eps") or 1e-6)}  # Cohere2-MoE writes null
        if doc.get("num_local_experts"):
            shape.update(n_experts=int(doc["num_local_experts"]), moe_every=1,
                         moe_top_k=int(doc.get("num_experts_per_tok", 2)))
    shape["tie_embeddings"] = bool(doc.get("tie_word_embeddings", kind in TIED_BY_DEFAULT))
    return {k: (int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and k not in
                ("rope_theta", "norm_eps") else v) for k, v in shape.items()}


def family(path: str | Path) -> str | None:
    """The family whose tp/pp/ep rules tessel has for this config, None for another architecture."""
    return FAMILIES.get(read_config(path)["model_type"])
