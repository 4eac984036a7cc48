"""Whether context parallelism can split a Hugging Face model's sequences: read from the model itself.

Context parallelism (tessel.parallel.context) replaces one thing in a transformers model: the function its
attention layers call through transformers' attention interface (ALL_ATTENTION_FUNCTIONS, chosen by
config._attn_implementation), and calls the model with each rank's global position ids. That is right for
a family exactly when every token mixer of every decoder layer goes through that interface, and everything
the layer hands the function is something ring and Ulysses attention apply. So the model is built on the
meta device (no memory, no weights) and read:

- every decoder layer must hold an attention module whose forward calls the interface; a layer without
  one mixes tokens some other way (a Mamba or linear-attention layer of a hybrid) and is named;
- no other sequence mixer may sit beside it (a causal convolution, nn.Conv1d: Mamba, short convolutions,
  gated delta rules);
- the keywords the attention module hands the interface must be ones tessel's function applies: the
  scaling (query_pre_attn_scalar, attention_multiplier arrive in it), the layer's sliding window and
  Gemma 2's soft-cap (tessel.parallel.context.kernel.Scores), dropout (refused unless 0), and the varlen
  and position keywords that are None or unused in training; any other (attention sinks `s_aux`, a sparse
  indexer's `indices`, a relative position bias) is named;
- the config's layer_types may hold full and sliding attention only, and no attention_chunk_size (chunked
  attention arrives as a mask, which a custom attention function is never given);
- the causal LM's forward must take position_ids (each rank's rotary angles, or learned positions, are
  those of its own chunks).

transformers loads torch on import: tessel.config calls this only for a recipe naming model.hf_config with
cp > 1, after transformers' own verdict on the config (tessel.hf.check), and caches it per config.
"""

from __future__ import annotations

import ast
import functools
import inspect
import json
import textwrap
import warnings

from tessel.hf.config import transformers_config
from tessel.hf.layout import cached_meta_model

# keywords an attention module may hand the interface that tessel's function applies or that are None in
# training (packed-sequence lengths, which tessel never passes); `dropout` is refused by the config's value
HANDLED = {"dropout", "scaling", "sliding_window", "softcap", "position_ids", "is_causal", "attention_mask",
           "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
ATTENTION_LAYER_TYPES = {"full_attention", "sliding_attention"}
DROPOUT_KEYS = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")


def hf_cp_refusal(doc: dict) -> str | None:
    """Why ring and Ulysses attention cannot split the sequences of the Hugging Face model whose config.json
    reads `doc` (one line naming the key, module or keyword), or None."""
    return _refusal(json.dumps(doc, sort_keys=True))


@functools.lru_cache(maxsize=32)
def _refusal(text: str) -> str | None:
    # deferred: transformers loads torch; only a Hugging Face recipe under cp > 1 pays for it, once per config
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils import logging
    doc = json.loads(text)
    logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        config = transformers_config(doc)
        model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
        problem = _dropout_problem(config) or _layer_types_problem(config) or _positions_problem(model_class)
        if problem is not None:
            return problem
        try:
            model = cached_meta_model(text)  # the tp, pp and ep checks' build of the same config
        except Exception as err:  # whatever stops the class building on the meta device, on one line
            return (f"context parallelism reads the model's layers, but {model_class.__name__} does not build from "
                    f"this config (on the meta device: {type(err).__name__}: {' '.join(str(err).split())})")
        return _layers_problem(model)


def _dropout_problem(config) -> str | None:
    key = next((k for k in DROPOUT_KEYS if getattr(config, k, 0)), None)
    return None if key is None else (f"context parallelism computes attention without dropout; set the model's "
                                     f"{key} to 0")


def _layer_types_problem(config) -> str | None:
    other = sorted(set(getattr(config, "layer_types", None) or ()) - ATTENTION_LAYER_TYPES)
    if other:
        return (f"context parallelism splits attention through transformers' attention interface; the model's "
                f"layer_types hold {', '.join(map(repr, other))} layers, which mix tokens otherwise")
    if getattr(config, "attention_chunk_size", None):
        return ("context parallelism computes causal or sliding-window attention; the model's attention_chunk_size "
                "(chunked attention, a mask transformers builds only for its own attention functions) is not built")
    return None


def _positions_problem(model_class: type) -> str | None:
    if "position_ids" in inspect.signature(model_class.forward).parameters:
        return None
    return (f"context parallelism calls the model with each rank's position_ids, which {model_class.__name__}."
            "forward does not take")


def _layers_problem(model) -> str | None:
    for index, layer in enumerate(_decoder_layers(model)):
        why = _layer_problem(index, layer)
        if why is not None:
            return why
    return None


def _decoder_layers(model) -> list:
    """The decoder layers: the model's longest nn.ModuleList (the one base_model_pp_plan calls `layers`)."""
    import torch.nn as nn  # deferred: loaded by transformers already
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def _layer_problem(index: int, layer) -> str | None:
    import torch.nn as nn  # deferred: loaded by transformers already
    where = f"decoder layer {index} ({type(layer).__name__})"
    attention = [m for m in layer.modules() if _calls_interface(type(m))]
    if not attention:
        mixers = ", ".join(f"{n} ({type(m).__name__})" for n, m in layer.named_children())
        return (f"context parallelism splits attention through transformers' attention interface; {where} has "
                f"none (it holds {mixers})")
    conv = next(((n, m) for n, m in layer.named_modules() if isinstance(m, nn.Conv1d)), None)
    if conv is not None:
        return (f"context parallelism splits attention only; {where} also mixes tokens by a convolution along the "
                f"sequence ({conv[0]}: {type(conv[1]).__name__})")
    for module in attention:
        other = sorted(_interface_keywords(type(module)) - HANDLED)
        if other:
            return (f"context parallelism's attention does not apply what {type(module).__name__} hands "
                    f"transformers' attention interface as {', '.join(other)} (it applies the causal mask of the "
                    "positions, the scaling, a sliding window and a soft-cap)")
    return None


@functools.cache
def _calls_interface(cls: type) -> bool:
    """Whether the class's forward calls transformers' attention interface."""
    return "ALL_ATTENTION_FUNCTIONS" in _forward_source(cls)


@functools.cache
def _interface_keywords(cls: type) -> frozenset[str]:
    """The keywords of the class's forward's call of the interface (`attention_interface(...)`), and
    "a mask of its own" where the mask it hands over is not the layer's `attention_mask` passed through (a
    mask the attention module makes itself, as Doge's dynamic mask: transformers builds none for tessel's
    function, so one passed through is None)."""
    keywords = set()
    for node in ast.walk(ast.parse(_forward_source(cls))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "attention_interface":
            masks = node.args[4:5] + [kw.value for kw in node.keywords if kw.arg == "attention_mask"]
            own = [m for m in masks if getattr(m, "id", None) != "attention_mask"]
            keywords |= {kw.arg for kw in node.keywords if kw.arg is not None} | ({"a mask of its own"} if own else set())
    return frozenset(keywords)


@functools.cache
def _forward_source(cls: type) -> str:
    forward = cls.__dict__.get("forward") or getattr(cls, "forward", None)
    try:
        return textwrap.dedent(inspect.getsource(forward))
    except (OSError, TypeError):  # a built-in module's forward: not one of transformers' attention classes
        return ""
