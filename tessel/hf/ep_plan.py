"""Where a Hugging Face MoE keeps its experts, from transformers' own expert-parallel plan.

transformers 5 declares, for its MoE families, `config.base_model_ep_plan`: module patterns under the base
model with a style each. "ep_dispatch_experts" names the experts module (`layers.*.mlp.experts`), which the
family's MoE block calls as `experts(hidden_states, top_k_index, top_k_weights)` with its own router's
choices (global expert ids, (N, k)) and weights (N, k); "grouped_gemm" names its parameters that hold one
slice per expert along dim 0 (`gate_up_proj` (E, ...), `down_proj` (E, ...), GPT-OSS's biases (E, ...)).
transformers' own expert parallelism (transformers.distributed.expert_parallel) keeps E/ep experts per rank,
sets the module's `num_experts` to that, and runs the module's own forward on the rows sent to this rank with
local expert ids. tessel does the same with its own all-to-all (tessel.parallel.expert.hf_experts); the
router, shared experts and dense layers stay whole on every rank (their gradients averaged over dp x ep).

The rules here read the built model (`expert_sites`) and say why a model's experts cannot be placed, naming
the module (`ep_problem`); `hf_ep_refusal` asks that of a config.json before any process starts, on a model
built on the meta device (no memory, ~1 s for DeepSeek-V3's 671B). torch and transformers load on the call.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tessel.hf.config import transformers_config
from tessel.hf.layout import cached_meta_model

if TYPE_CHECKING:
    import torch.nn as nn

EXPERTS = "ep_dispatch_experts"  # the module the routed tokens are handed to
PER_EXPERT = "grouped_gemm"  # a parameter with one slice per expert along dim 0
# styles transformers uses inside an ep plan for what tessel keeps whole on every ep rank (each rank routes
# its own tokens through it, its gradient averaged over dp x ep like any replicated weight): a parameter it
# all-reduces (MuseSpark's post-expert norm), the dense MLP beside the experts it splits over the ep mesh
# like tp (Gemma 4)
KEPT_WHOLE = ("replicated_with_grad_allreduce", "colwise", "rowwise")
ROUTED_ARGS = 3  # hidden_states (N, C), the router's expert ids (N, k), its weights (N, k)


@dataclass(frozen=True)
class ExpertSite:
    """One experts module of the plan: its name in the model, the module, and its per-expert parameters."""
    name: str
    module: nn.Module
    n_experts: int
    params: tuple[str, ...]  # its parameter names (local to the module) split along dim 0


def ep_plan(model: nn.Module) -> dict[str, str]:
    """The plan's patterns, under the model (prefixed with the base model's name) -> style."""
    plan = getattr(getattr(model, "config", None), "base_model_ep_plan", None) or {}
    return {f"{model.base_model_prefix}.{key}": style for key, style in plan.items()}


def expert_sites(model: nn.Module) -> list[ExpertSite]:
    """Every experts module the plan names, with the parameters it splits (unchecked: see ep_problem)."""
    plan = ep_plan(model)
    modules = [p for p, s in plan.items() if s == EXPERTS]
    per_expert = [p for p, s in plan.items() if s == PER_EXPERT]
    sites = []
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in modules):
            params = tuple(n for n, _ in module.named_parameters()
                           if any(fnmatch.fnmatchcase(f"{name}.{n}", p) for p in per_expert))
            sites.append(ExpertSite(name, module, int(getattr(module, "num_experts", 0) or 0), params))
    return sites


def ep_problem(model: nn.Module, ep: int) -> str | None:
    """Why the model's experts cannot be split over `ep` ranks (naming the module or key), or None."""
    plan = ep_plan(model)
    why = plan_problem(model.config.model_type, plan)
    if why is not None:
        return why
    sites = expert_sites(model)
    if not sites:
        wanted = [key for key, style in plan.items() if style == EXPERTS]
        return (f"this '{model.config.model_type}' config builds no experts module its expert-parallel plan names "
                f"({', '.join(wanted)}): no MoE layer to split")
    return next((why for site in sites if (why := _site_problem(site, ep)) is not None), None)


def plan_problem(kind: str, plan: dict[str, str]) -> str | None:
    """Why the plan itself (pattern -> style) cannot guide tessel: there is none, or a style tessel does not map."""
    if not plan:
        return (f"a '{kind}' model has no expert-parallel plan (its config class declares no base_model_ep_plan), "
                "so tessel cannot tell which modules hold its experts")
    unknown = [f"'{key}' ({style})" for key, style in plan.items() if style not in (EXPERTS, PER_EXPERT, *KEPT_WHOLE)]
    if unknown:
        return f"transformers' expert-parallel plan asks {', '.join(unknown)}, which tessel does not map"
    return None


def _site_problem(site: ExpertSite, ep: int) -> str | None:
    """Why one experts module cannot run E/ep experts per rank through its own forward, or None."""
    where = f"'{site.name}' ({type(site.module).__name__})"
    takes = list(inspect.signature(site.module.forward).parameters)
    if len(takes) != ROUTED_ARGS:
        return (f"{where} takes ({', '.join(takes)}), not the routed tokens, expert ids and weights that "
                "tessel's all-to-all hands an experts module")
    if site.n_experts < 1 or not site.params:
        return f"{where} has no num_experts or no parameter the plan splits by expert"
    for name, param in site.module.named_parameters():
        split = name in site.params
        if split and param.shape[0] != site.n_experts:
            return (f"'{site.name}.{name}' has {param.shape[0]} rows on dim 0, not one per expert "
                    f"({site.n_experts})")
        if not split and param.dim() > 1 and param.shape[0] == site.n_experts:
            return f"'{site.name}.{name}' holds one slice per expert, and the plan does not split it"
    if site.n_experts % ep:
        return f"{where} has {site.n_experts} experts, which ep ({ep}) does not divide"
    return None


def hf_ep_refusal(doc: dict, ep: int) -> str | None:
    """Why `ep` ranks cannot split the experts of the model whose config.json reads `doc`, or None."""
    return _refusal(json.dumps(doc, sort_keys=True), ep)


@functools.lru_cache(maxsize=16)
def _refusal(doc_json: str, ep: int) -> str | None:  # one meta build per config and degree
    doc = json.loads(doc_json)
    why = plan_problem(doc["model_type"], getattr(_config(doc), "base_model_ep_plan", None) or {})
    if why is not None:  # answered from the config alone
        return why
    try:
        model = cached_meta_model(doc_json)
    except Exception as err:  # the family's own classes refuse the config: every rank would fail the same way
        return (f"transformers cannot build this '{doc['model_type']}' config's model to find its experts: "
                f"{type(err).__name__}: {' '.join(str(err).split())}")
    return ep_problem(model, ep)


def _config(doc: dict):
    # deferred: transformers loads torch; only a recipe naming a Hugging Face MoE under ep asks
    from transformers.utils import logging
    logging.set_verbosity_error()  # its warnings about a shrunk or hand-made config are hf_check's concern
    return transformers_config(doc)
