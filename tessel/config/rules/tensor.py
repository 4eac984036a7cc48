"""1D tensor parallelism (tessel.parallel.tensor) and sequence parallelism: heads, kv heads and the
feed-forward split over tp; under sequence parallelism the sequence too. A grid mode splits heads and widths
over its grid's sides instead (tessel.config.rules.tensor_nd)."""

from __future__ import annotations

from tessel.config.rule import Rule


def _one_d(c) -> bool:
    return c.parallel.tp_mode == "1d"


RULES = [
    Rule("parallel.tp", lambda c: c.model.n_head % c.parallel.tp == 0,
         lambda c: f"model.n_head ({c.model.n_head}) is not divisible by tp ({c.parallel.tp})", when=_one_d),
    Rule("parallel.tp", lambda c: c.model.kv_heads % c.parallel.tp == 0,
         lambda c: f"model.n_kv_head ({c.model.kv_heads}) is not divisible by tp ({c.parallel.tp})", when=_one_d),
    Rule("parallel.tp", lambda c: c.model.ffn_dim % c.parallel.tp == 0,
         lambda c: f"model.d_ff ({c.model.ffn_dim}) is not divisible by tp ({c.parallel.tp})", when=_one_d),
]

SEQUENCE_PARALLEL = [
    Rule("parallel.sequence_parallel", lambda c: not c.parallel.sequence_parallel or c.parallel.tp > 1,
         "needs tp > 1"),
    Rule("train.seq_len", lambda c: c.train.seq_len % c.parallel.tp == 0,
         lambda c: f"({c.train.seq_len}) must be divisible by tp ({c.parallel.tp}) under sequence parallelism",
         when=lambda c: c.parallel.sequence_parallel),
]

_SPLIT_BACKWARD = ("zb-h1", "zb-h2", "zbv")

TP_OVERLAP = [
    Rule("parallel.tp_overlap", lambda c: c.parallel.tp > 1, "needs tp > 1", when=lambda c: c.parallel.tp_overlap),
    Rule("parallel.tp_overlap", lambda c: c.parallel.tp_mode in ("1d", "2d"),
         lambda c: f"overlaps 1d (Megatron with sequence_parallel) and 2d (SUMMA), not tp_mode {c.parallel.tp_mode!r}",
         when=lambda c: c.parallel.tp_overlap),
    Rule("parallel.tp_overlap", lambda c: c.parallel.sequence_parallel or c.parallel.tp_mode != "1d",
         "in 1d needs sequence_parallel = true (it overlaps the sequence all-gather and reduce-scatter)",
         when=lambda c: c.parallel.tp_overlap),
    Rule("parallel.tp_overlap", lambda c: c.train.compile == "off",
         "needs train.compile = 'off' (its ring of point-to-point sends is driven eagerly, step by step)",
         when=lambda c: c.parallel.tp_overlap),
    Rule("parallel.tp_overlap", lambda c: c.parallel.pp == 1 or c.parallel.schedule not in _SPLIT_BACKWARD,
         lambda c: f"cannot run under schedule {c.parallel.schedule!r}: a split backward would need each "
                   "overlapped linear's input and weight gradients apart, which its ring computes together",
         when=lambda c: c.parallel.tp_overlap),
]
