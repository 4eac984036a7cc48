"""ZeRO (parallel.zero_stage, tessel.parallel.zero): bf16 parameter storage or reduction is built for the
stages that own a sharded fp32 master copy, without a pipeline."""

from __future__ import annotations

from tessel.config.rule import Rule


def _mixed(c) -> bool:
    p = c.parallel
    return p.zero_param_dtype != "fp32" or p.zero_reduce_dtype not in (None, "fp32")


RULES = [
    Rule("parallel.zero_param_dtype", lambda c: not _mixed(c) or (c.parallel.zero_stage > 0 and c.parallel.pp == 1),
         "bf16 parameter storage or reduction needs parallel.zero_stage 1-3 and pp = 1"),
]
