"""check_layout: every rule that ties a recipe's sections together, in one fixed order, the first broken one
reported by field (tessel.config.rules holds them, a file per strategy). Checked before anything is spawned,
so a bad recipe fails in a second with a message that names the field."""

from __future__ import annotations

from tessel.config.rule import Rule, check_rules
from tessel.config.rules import (compile, context, data, documents, expert, fault, float8, fused_loss, hf, mesh,
                                 pipeline, ps, runtime, tensor, tensor_nd, train, uneven, zero)
from tessel.config.schema import Config
from tessel.errors import ConfigError

# The order is the order refusals are reported in: where a recipe breaks several rules, the first is named.
ORDER: tuple[list[Rule[Config]], ...] = (
    ps.RULES, mesh.RULES, tensor.RULES, tensor_nd.RULES, context.RULES, documents.RULES, fused_loss.RULES,
    pipeline.RULES, compile.RULES, float8.RULES, zero.RULES, expert.RULES, tensor.SEQUENCE_PARALLEL,
    tensor.TP_OVERLAP, train.RULES,
    hf.RULES,  # transformers' verdict loads it: after the rules that need neither transformers nor torch
    data.RULES, runtime.RULES, uneven.RULES, fault.RULES, runtime.NODES,
)


def check_layout(cfg: Config, world_size: int | None = None) -> None:
    """The rules that tie sections together. Raises ConfigError naming the field."""
    p = cfg.parallel
    if world_size is not None and p.world_size != world_size:
        raise ConfigError("parallel", f"pp*dp*ep*cp*tp (+ ps_servers) = {p.world_size} but the world size is "
                                      f"{world_size}")
    for rules in ORDER:
        check_rules(rules, cfg)
