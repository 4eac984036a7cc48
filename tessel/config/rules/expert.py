"""Expert parallelism (parallel.ep, tessel.parallel.expert) and the reference MoE's router (tessel.models.moe): an
MoE model's experts split evenly over ep; the router's groups, shared experts and balancing. A Hugging Face model's
own check names its model type (tessel.config.rules.hf)."""

from __future__ import annotations

from tessel.config.rule import Rule


def _groups_align_with_ep(c) -> bool:
    """A group of consecutive experts is one ep rank's experts, several whole ranks' (a node's), or a whole
    share of one rank's: groups and ranks cut the experts at the same boundaries."""
    g, ep = c.model.moe_route_groups, c.parallel.ep
    return ep % g == 0 or g % ep == 0


def _router_default(c, field: str) -> bool:
    defaults = {"n_shared_experts": 0, "moe_score": "softmax", "moe_norm_topk": None, "moe_route_groups": 1,
                "moe_route_group_limit": None, "balance": "aux_loss"}
    return getattr(c.model, field) == defaults[field]


_REFERENCE_ONLY = ["n_shared_experts", "moe_score", "moe_norm_topk", "moe_route_groups", "moe_route_group_limit",
                   "balance"]

RULES = [
    Rule("parallel.ep", lambda c: c.parallel.ep == 1 or c.model.n_experts > 0 or c.model.hf_config is not None,
         "ep > 1 needs an MoE model (model.n_experts > 0)"),
    Rule("parallel.ep", lambda c: c.model.n_experts % c.parallel.ep == 0,
         lambda c: f"model.n_experts ({c.model.n_experts}) is not divisible by ep ({c.parallel.ep})",
         when=lambda c: c.model.n_experts > 0),
    *[Rule(f"model.{field}", lambda c, f=field: c.model.hf_config is None or _router_default(c, f),
           "sets the reference GPT's router; a Hugging Face MoE routes as its config declares") for field in
      _REFERENCE_ONLY],
    *[Rule(f"model.{field}", lambda c, f=field: c.model.n_experts > 0 or _router_default(c, f),
           "sets an MoE router: needs model.n_experts > 0") for field in _REFERENCE_ONLY],
    Rule("model.moe_route_groups", lambda c: c.model.n_experts % c.model.moe_route_groups == 0,
         lambda c: f"({c.model.moe_route_groups}) must divide model.n_experts ({c.model.n_experts})",
         when=lambda c: c.model.n_experts > 0 and c.model.hf_config is None),
    Rule("model.moe_route_group_limit",
         lambda c: c.model.moe_route_group_limit is None or c.model.moe_route_group_limit <= c.model.moe_route_groups,
         lambda c: f"({c.model.moe_route_group_limit}) exceeds model.moe_route_groups ({c.model.moe_route_groups})"),
    Rule("model.moe_route_group_limit",
         lambda c: (c.model.moe_route_group_limit or c.model.moe_route_groups) * c.model.n_experts
         >= c.model.moe_top_k * c.model.moe_route_groups,
         lambda c: f"({c.model.moe_route_group_limit}) groups of {c.model.n_experts // c.model.moe_route_groups} "
                   f"experts hold fewer than model.moe_top_k ({c.model.moe_top_k})",
         when=lambda c: c.model.n_experts > 0 and c.model.hf_config is None),
    Rule("model.moe_route_groups", _groups_align_with_ep,
         lambda c: f"({c.model.moe_route_groups}) groups and ep ({c.parallel.ep}) must divide one another, so that "
                   "a group is whole ep ranks or a whole share of one",
         when=lambda c: c.model.n_experts > 0 and c.model.moe_route_groups > 1),
    Rule("model.aux_loss_coef", lambda c: c.model.balance != "none" or c.model.aux_loss_coef == 0,
         "must be 0 with model.balance = 'none' (no load-balancing loss)",
         when=lambda c: c.model.n_experts > 0),
    Rule("model.balance", lambda c: c.model.balance != "bias" or c.parallel.dp_arch != "ps",
         "'bias' moves the biases after the trainer's optimizer step, which a parameter server's workers do not "
         "take (set balance = 'aux_loss', or dp_arch = 'allreduce')"),
    Rule("model.moe_random_routing", lambda c: not c.model.moe_random_routing or c.model.moe_score == "softmax",
         "drops second choices by their softmax gate: needs model.moe_score = 'softmax'"),
]
