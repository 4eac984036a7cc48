"""Heterogeneous devices (tessel.parallel.data.uneven, tessel.planner.hetero): per-rank declarations cover every
rank; an uneven dp split runs where each dp rank's micro-batches reduce once per step (plain DP or ZeRO-1, no
pipeline, no experts: their collectives run per micro-batch and would wait on a rank with fewer)."""

from __future__ import annotations

from tessel.config.rule import Rule


def _per_rank(name: str) -> list[Rule]:
    """runtime.<name>: one positive entry per rank (elastic runs may change the world)."""
    def given(c) -> bool:
        return getattr(c.runtime, name) is not None
    return [
        Rule(f"runtime.{name}", lambda c: len(getattr(c.runtime, name)) == c.parallel.world_size or c.runtime.elastic,
             lambda c: f"has {len(getattr(c.runtime, name))} entries; the layout has {c.parallel.world_size} ranks "
             "(one per rank)", when=given),
        Rule(f"runtime.{name}", lambda c: all(v > 0 for v in getattr(c.runtime, name)), "entries must be positive",
             when=given),
    ]


def _shares(c) -> bool:
    return c.parallel.dp_shares is not None


def _want(c) -> int:
    return c.parallel.dp * c.train.grad_accum * c.parallel.micro_batches


def _uneven(c) -> bool:
    return c.parallel.dp_shares is not None or c.parallel.dp_split == "speed"


def _uneven_field(c) -> str:
    return "parallel.dp_shares" if c.parallel.dp_shares is not None else "parallel.dp_split"


RULES = [
    *_per_rank("device_speeds"),
    *_per_rank("device_memory_gib"),
    Rule("parallel.dp_shares", lambda c: c.parallel.dp_split == "speed" or len(c.parallel.dp_shares) == c.parallel.dp,
         lambda c: f"has {len(c.parallel.dp_shares)} entries; dp is {c.parallel.dp} (one per dp rank)", when=_shares),
    Rule("parallel.dp_shares", lambda c: min(c.parallel.dp_shares) >= 1 and sum(c.parallel.dp_shares) == _want(c),
         lambda c: f"entries must be >= 1 and sum to dp*grad_accum*micro_batches = {_want(c)}", when=_shares),
    Rule(_uneven_field, lambda c: c.parallel.pp == 1 and c.parallel.ep == 1 and c.model.n_experts == 0,
         "an uneven dp split needs pp = 1 and no experts (their collectives run per micro-batch)", when=_uneven),
    Rule(_uneven_field, lambda c: c.parallel.cp == 1,
         "an uneven dp split is not built with context parallelism (cp = 1)", when=_uneven),
    Rule(_uneven_field, lambda c: c.parallel.zero_stage <= 1 and c.parallel.dp_arch == "allreduce",
         "an uneven dp split needs plain dp or ZeRO-1 (stages 2-3 reduce per micro-batch)", when=_uneven),
]
