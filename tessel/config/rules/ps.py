"""A parameter server (tessel.train.ps.trainer) serves a whole replicated model to dp workers."""

from __future__ import annotations

from tessel.config.rule import Rule


def _ps(c) -> bool:
    return c.parallel.dp_arch == "ps"


def _allreduce(c) -> bool:
    return c.parallel.dp_arch != "ps"


RULES = [
    Rule("parallel.ps_mode", lambda c: c.parallel.ps_mode == "bsp" and c.parallel.ps_staleness == 0,
         "ps_mode and ps_staleness apply only with parallel.dp_arch = 'ps'", when=_allreduce),
    *(Rule(f"parallel.{axis}", lambda c, axis=axis: getattr(c.parallel, axis) == 1,
           "must be 1 with parallel.dp_arch = 'ps' (workers hold the whole model)", when=_ps)
      for axis in ("tp", "pp", "ep")),
    Rule("parallel.zero_stage", lambda c: c.parallel.zero_stage == 0, "must be 0 with parallel.dp_arch = 'ps' "
         "(the servers shard the optimizer state)", when=_ps),
    Rule("parallel.ps_staleness", lambda c: c.parallel.ps_mode == "ssp" or c.parallel.ps_staleness == 0,
         "applies only to ps_mode = 'ssp'", when=_ps),
    Rule("runtime.elastic", lambda c: not c.runtime.elastic, "is not supported with parallel.dp_arch = 'ps'",
         when=_ps),
]
