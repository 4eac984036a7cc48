"""Expert parallelism (parallel.ep, tessel.parallel.expert): an MoE model's experts split evenly over ep. A
Hugging Face model's own check names its model type (tessel.config.rules.hf)."""

from __future__ import annotations

from tessel.config.rule import Rule

RULES = [
    Rule("parallel.ep", lambda c: c.parallel.ep == 1 or c.model.n_experts > 0 or c.model.hf_config is not None,
         "ep > 1 needs an MoE model (model.n_experts > 0)"),
    Rule("parallel.ep", lambda c: c.model.n_experts % c.parallel.ep == 0,
         lambda c: f"model.n_experts ({c.model.n_experts}) is not divisible by ep ({c.parallel.ep})",
         when=lambda c: c.model.n_experts > 0),
]
