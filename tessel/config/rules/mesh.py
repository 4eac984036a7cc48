"""The mesh's axes: their order from outermost to innermost (tessel.axes)."""

from __future__ import annotations

from tessel.axes import AXES
from tessel.config.rule import Rule

RULES = [
    Rule("parallel.rank_order", lambda c: sorted(c.parallel.rank_order) == sorted(AXES),
         f"must be a permutation of {list(AXES)}"),
]
