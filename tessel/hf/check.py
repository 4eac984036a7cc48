"""A Hugging Face config.json as transformers itself judges it, before any process starts.

tessel.hf.shape reads the few fields tessel needs from the JSON, without transformers; what only transformers
knows is asked here, once per file: whether the family's configuration class takes the file (its own strict
validation: field types, layer_types, rope parameters), whether the model type has a causal LM, whether the
padding id the embedding is built with lies in the vocabulary, and, where the config asks for the router's
load-balancing loss, whether the family's is the one tessel computes (tessel.models.hf.moe). A config that
passes builds on every rank exactly as here (tessel.models.hf.build reads it the same way).

transformers loads torch on import (a second or two): tessel.config calls this only for a recipe naming
model.hf_config, after the rules that need neither, and every import of transformers is deferred to the call.
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from pathlib import Path
from typing import Callable

from tessel.hf.config import transformers_config
from tessel.hf.shape import config_file, read_config

# transformers' load_balancing_loss_func as Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, PhiMoE, GraniteMoE, ... define it
# (each family keeps its own copy): Switch's E * sum_i f_i * P_i over the top-k choices of every layer's rows
STANDARD_BALANCE_LOSS = ("gate_logits", "num_experts", "top_k", "attention_mask")


def hf_config_problem(path: str | Path) -> str | None:
    """Why transformers would not build a causal LM from this config (one line, naming the key), or None."""
    file = config_file(path)
    stat = file.stat()
    return _problem(str(file), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _problem(file: str, mtime_ns: int, size: int) -> str | None:  # the stamp: a file edited in place is re-read
    # deferred: transformers loads torch; only a recipe naming a Hugging Face config pays for it, once per file
    from transformers.utils import logging
    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # what it would only warn about is refused here, or warned about by each rank
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return _transformers_problem(read_config(file))
    finally:
        logging.set_verbosity(verbosity)


def _transformers_problem(doc: dict) -> str | None:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    kind = doc.pop("model_type")
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (f"model_type {kind!r}: transformers has no causal LM for it (AutoModelForCausalLM takes "
                f"{len(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)} model types, such as llama, qwen3, gemma2, mixtral)")
    try:
        config = transformers_config({"model_type": kind, **doc})
    except Exception as err:  # whatever the family's class raises is the user's answer, on one line
        return f"transformers' configuration class for {kind!r} rejects it: {' '.join(str(err).split())}"
    return _padding_problem(config) or _router_loss_problem(config)


def _padding_problem(config) -> str | None:
    """transformers' own rule for special ids (PreTrainedConfig.validate_token_ids, which only warns): `None` or
    an id within the vocabulary. The padding id is the one that fails: the embedding is built with it as its
    padding_idx, which torch refuses outside the table, on every rank."""
    text = config.get_text_config(decoder=True)
    vocab, pad = getattr(text, "vocab_size", None), getattr(text, "pad_token_id", None)
    if isinstance(vocab, int) and isinstance(pad, int) and not 0 <= pad < vocab:
        return (f"pad_token_id must be `None` or an integer within the vocabulary (between 0 and {vocab - 1}), got "
                f"{pad} (transformers' validate_token_ids; the embedding's padding_idx); set it to null or an id "
                "below vocab_size")
    return None


def _router_loss_problem(config) -> str | None:
    """output_router_logits asks for the family's load-balancing loss; tessel computes the standard one itself
    (its statistics can then span the whole batch), and refuses another family's by name."""
    if not getattr(config, "output_router_logits", False):
        return None
    # deferred: the family's modeling module (loads transformers' modeling code), asked only for a router loss
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    loss = balance_loss_of(model_class)
    if loss is None or is_standard_balance_loss(loss):
        return None
    takes = ", ".join(inspect.signature(loss).parameters)
    return (f"output_router_logits: {model_class.__name__}'s load_balancing_loss_func({takes}) is not the one "
            f"tessel computes (Switch's over the top-k choices: ({', '.join(STANDARD_BALANCE_LOSS)})); set "
            "output_router_logits to false")


def balance_loss_of(model_class: type) -> Callable | None:
    """The load-balancing loss the family's causal LM adds when its config outputs router logits: its modeling
    module's load_balancing_loss_func; None for a family that adds none (DeepSeek-V3 balances by a bias)."""
    return getattr(sys.modules[model_class.__module__], "load_balancing_loss_func", None)


def is_standard_balance_loss(loss: Callable) -> bool:
    return tuple(inspect.signature(loss).parameters) == STANDARD_BALANCE_LOSS
