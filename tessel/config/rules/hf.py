"""A Hugging Face model (model.hf_config): transformers' own verdict on its config first, then what each
strategy needs of the architecture, read from its config.json and, for tp, pp, ep and cp, from the model built
on the meta device (tessel.hf.layout, tessel.hf.ep_plan, tessel.hf.context). tp > 1 splits the families tessel
has rules for (hf_tp_refusal); their heads, kv heads and feed-forward split over tp like the reference GPT's
(tessel.config.rules.tensor, from the shape the config filled in); the vocabulary is padded to a multiple of tp.
pp > 1 cuts the families tessel knows (hf_pp_refusal). ep > 1 shards the experts modules that the model's
base_model_ep_plan names, E/ep experts a rank (tessel.parallel.expert.hf_experts). cp > 1: every token mixer of
every layer must be attention through transformers' attention interface, handing it nothing ring and Ulysses
attention do not apply; sliding windows and soft-capping are applied across the ranks."""

from __future__ import annotations

from tessel.config.rule import Rule
from tessel.hf.check import hf_config_problem
from tessel.hf.context import hf_cp_refusal
from tessel.hf.ep_plan import hf_ep_refusal
from tessel.hf.layout import pp_problem, tp_problem
from tessel.hf.shape import OWN_RULES, read_config


def hf_tp_refusal(doc: dict) -> str | None:
    """Why tensor parallelism (1D, with or without sequence parallelism) cannot split the Hugging Face model
    whose config.json reads `doc`, or None. A family with rules of tessel's own (tessel.hf.shape.OWN_RULES, no
    plans in its config) is split by them; any other is placed from its own plans by the derivation the ranks
    run (tessel.hf.layout, on the model built on the meta device), which names what it cannot place (Cohere's
    optional q/k norms, a weight per head its plan does not split; a latent attention no plan names). The
    shapes (heads, kv heads, feed-forward over tp) are check_layout's."""
    kind = doc["model_type"]
    why = None if kind in OWN_RULES else tp_problem(doc)
    return None if why is None else f"model_type {kind!r}: {why}; " \
        "this architecture trains under dp, ZeRO and recompute"


def hf_pp_refusal(doc: dict) -> str | None:
    """Why a pipeline cannot cut the Hugging Face model whose config.json reads `doc`, or None: a family with
    parts of tessel's own (OWN_RULES), or one whose base_model_pp_plan describes an embedding, one list of decoder
    layers and a head holding every weight (tessel.hf.layout.pipeline_cut, on the model built on the meta
    device)."""
    kind = doc["model_type"]
    why = None if kind in OWN_RULES else pp_problem(doc)
    return None if why is None else f"model_type {kind!r}: {why}; this " \
        "architecture trains under dp, ZeRO and recompute"



def _hf(c) -> bool:
    return c.model.hf_config is not None


def _doc(c) -> dict:
    return read_config(c.model.hf_config)


def _problem(c):
    return hf_config_problem(c.model.hf_config)  # transformers' own verdict (loads it)


def _tp_why(c) -> str | None:
    return hf_tp_refusal(_doc(c))


def _pp_why(c) -> str | None:
    return hf_pp_refusal(_doc(c))


def _ep_why(c) -> str | None:
    return hf_ep_refusal(_doc(c), c.parallel.ep)


def _cp_why(c) -> str | None:
    return hf_cp_refusal(_doc(c))


def _refusal(field: str, why, when) -> Rule:
    """The rule `why(cfg)` (a refusal, None when the model allows it) gives: its text is the message."""
    return Rule(field, lambda c: why(c) is None, lambda c: str(why(c)), when=lambda c: _hf(c) and when(c))


RULES = [
    _refusal("model.hf_config", _problem, lambda c: True),
    Rule("parallel.recompute", lambda c: c.parallel.recompute != "selective", "selective recomputes the reference "
         "GPT's attention core; a Hugging Face model takes 'full' or 'none'", when=_hf),
    _refusal("parallel.tp", _tp_why, lambda c: c.parallel.tp != 1),
    _refusal("parallel.pp", _pp_why, lambda c: c.parallel.pp != 1),
    Rule("parallel.pp_balance", lambda c: c.parallel.pp_balance != "time", "'time' times the reference GPT's "
         "blocks; a Hugging Face model under pp > 1 is balanced by 'layers' or 'params'",
         when=lambda c: _hf(c) and c.parallel.pp != 1),
    # its aux loss mixes the statistics of every layer: each stage's share (tessel.parallel.expert.cross_stage)
    # follows the micro-batches of its chunk in order, one chunk per rank
    Rule("parallel.virtual_stages",
         lambda c: c.parallel.pp == 1 or c.parallel.virtual_stages == 1 or not _doc(c).get("output_router_logits"),
         "the router aux loss (output_router_logits) spans every layer; under pp > 1 it is computed "
         "with one chunk per pipeline rank (virtual_stages = 1)", when=_hf),
    _refusal("parallel.ep", _ep_why, lambda c: c.parallel.ep != 1),
    _refusal("parallel.cp", _cp_why, lambda c: c.parallel.cp != 1),
]
