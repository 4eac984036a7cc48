"""Pipeline parallelism (parallel.pp, tessel.parallel.pipeline): the stages against the layers, the schedules'
own needs. ZBV (tessel.parallel.pipeline.zero_bubble) holds two stages per rank in a V: rank r runs stages r
and 2p-1-r, so the embedding and the head share rank 0. A split backward (zb-h1, zb-h2, zbv:
tessel.parallel.pipeline.split_backward) runs W as one autograd call per weight group; each would rebuild a
fully recomputed block again. pipedream and 2bw (tessel.parallel.pipeline.async_schedules) never flush: a step's
update uses weights older than the ones it changes, so the recipe must allow it; what they compose with is
listed here. A Hugging Face model's cut is judged in tessel.config.rules.hf."""

from __future__ import annotations

from tessel.config.rule import Rule

ASYNC = ("pipedream", "2bw")


def _stages(c) -> int:
    return c.parallel.pp * c.parallel.virtual_stages


def _zbv(c) -> bool:
    return c.parallel.schedule == "zbv"


def _split_backward(c) -> bool:
    return c.parallel.schedule in ("zb-h1", "zb-h2", "zbv")


def _async(c) -> bool:
    return c.parallel.schedule in ASYNC


def _has_layout(c) -> bool:
    return c.parallel.pp_layout is not None


STAGES = [
    Rule("parallel.pp", lambda c: c.model.n_layer >= _stages(c),
         lambda c: f"model.n_layer ({c.model.n_layer}) is fewer than the pipeline stages (pp*virtual_stages = "
         f"{_stages(c)})"),
    Rule("parallel.pp_layout", lambda c: len(c.parallel.pp_layout) == _stages(c),
         lambda c: f"needs {_stages(c)} entries (one per stage)", when=_has_layout),
    Rule("parallel.pp_layout",
         lambda c: sum(c.parallel.pp_layout) == c.model.n_layer and min(c.parallel.pp_layout) >= 1,
         lambda c: f"entries must be >= 1 and sum to model.n_layer ({c.model.n_layer})", when=_has_layout),
    Rule("parallel.virtual_stages",
         lambda c: c.parallel.virtual_stages == 1 or c.parallel.schedule in ("interleaved", "zbv"),
         "virtual_stages > 1 needs parallel.schedule = 'interleaved' or 'zbv'"),
]

ZBV = [
    Rule("parallel.virtual_stages", lambda c: c.parallel.virtual_stages == 2, "the zbv schedule holds 2 virtual "
         "stages per rank in a V; set virtual_stages = 2", when=_zbv),
    Rule("parallel.micro_batches", lambda c: c.parallel.micro_batches >= c.parallel.pp,
         lambda c: f"the zbv schedule needs at least pp ({c.parallel.pp}) micro-batches", when=_zbv),
    Rule("model.tie_embeddings", lambda c: not c.model.tie_embeddings or c.parallel.pp == 1, "the zbv schedule puts "
         "the embedding and the head on one rank, where a tied weight is not supported yet; untie them", when=_zbv),
]

SPLIT_BACKWARD = [
    Rule("parallel.recompute", lambda c: c.parallel.recompute != "full",
         lambda c: f"the '{c.parallel.schedule}' schedule's W would recompute each block once per weight; use "
         "'selective' or 'none'", when=_split_backward),
    Rule("parallel.cp", lambda c: c.parallel.cp == 1,
         lambda c: f"the '{c.parallel.schedule}' schedule's split backward is not built for context "
         "parallelism's attention yet", when=_split_backward),
]


def _no_tp_cp_ep_zero_ps(c) -> bool:
    p = c.parallel
    return p.tp == 1 and p.ep == 1 and p.cp == 1 and p.zero_stage == 0 and p.dp_arch == "allreduce"


ASYNCHRONOUS = [
    Rule("parallel.vertical_sync", lambda c: not c.parallel.vertical_sync or c.parallel.schedule == "pipedream",
         "is PipeDream's option; set parallel.schedule = 'pipedream'"),
    Rule("parallel.allow_async", lambda c: c.parallel.allow_async,
         lambda c: f"the '{c.parallel.schedule}' schedule updates on stale weights; set "
         "parallel.allow_async = true to accept that", when=_async),
    Rule("parallel.pp", lambda c: c.parallel.pp > 1, lambda c: f"the '{c.parallel.schedule}' schedule needs pp > 1",
         when=_async),
    Rule("parallel.virtual_stages", lambda c: c.parallel.virtual_stages == 1,
         lambda c: f"the '{c.parallel.schedule}' schedule runs one stage a rank", when=_async),
    Rule("parallel.micro_batches", lambda c: c.parallel.micro_batches * c.train.grad_accum >= c.parallel.pp,
         lambda c: f"the '{c.parallel.schedule}' schedule needs at least pp ({c.parallel.pp}) micro-batches a step",
         when=_async),
    Rule("parallel.schedule", _no_tp_cp_ep_zero_ps,
         lambda c: f"'{c.parallel.schedule}' composes with pp and dp (no tp, cp, ep, ZeRO or parameter "
         "server) so far", when=_async),
    Rule("parallel.schedule", lambda c: c.model.hf_config is None and c.model.n_experts == 0,
         lambda c: f"'{c.parallel.schedule}' runs the reference dense GPT so far", when=_async),
    Rule("model.tie_embeddings", lambda c: not c.model.tie_embeddings,
         lambda c: f"the '{c.parallel.schedule}' schedule keeps per-stage weight "
         "versions, which a weight shared by the first and the last stage does not have; untie them", when=_async),
    Rule("parallel.recompute", lambda c: c.parallel.recompute == "none",
         lambda c: f"the '{c.parallel.schedule}' schedule does not recompute yet", when=_async),
    Rule("checkpoint.every", lambda c: c.checkpoint.every == 0 and c.checkpoint.resume is None,
         lambda c: f"the '{c.parallel.schedule}' schedule's micro-batches in flight and stashed weights are not "
         "checkpointed yet; set checkpoint.every = 0", when=_async),
    Rule("train.grad_clip", lambda c: c.parallel.schedule != "pipedream" or c.train.grad_clip == 0,
         "pipedream updates each stage after every micro-batch, with no global gradient norm to clip by; set "
         "train.grad_clip = 0", when=_async),
]

INTERLEAVED = [
    Rule("parallel.micro_batches", lambda c: c.parallel.micro_batches % c.parallel.pp == 0,
         lambda c: f"the interleaved schedule needs micro_batches divisible by pp ({c.parallel.pp})",
         when=lambda c: c.parallel.schedule == "interleaved" and c.parallel.pp > 1),
]

RULES = STAGES + ZBV + SPLIT_BACKWARD + ASYNCHRONOUS + INTERLEAVED
