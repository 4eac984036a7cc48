"""Context parallelism (parallel.cp, tessel.parallel.context): every cp rank holds chunks r and 2cp-1-r of the
same sequences (the causal triangle balanced), so the sequence splits in 2*cp chunks, and under sequence
parallelism each rank's chunks split again over tp; Ulysses trades the sequence split for a head split, so each
tp rank's heads and kv heads split over cp. MoE models route each rank's chunks with the capacity and balance
statistics of the whole sequences (tessel.parallel.context.moe). What is not built or tested yet is refused by
name; a Hugging Face model's own attention is judged in tessel.config.rules.hf."""

from __future__ import annotations

from tessel.config.rule import Rule


def _cp(c) -> bool:
    return c.parallel.cp != 1


def _ulysses(c) -> bool:
    return _cp(c) and c.parallel.cp_mode == "ulysses"


def _heads(c) -> int:
    return c.model.n_head // c.parallel.tp  # each tp rank's (1d, checked before)


def _kv_heads(c) -> int:
    return c.model.kv_heads // c.parallel.tp


RULES = [
    Rule("train.seq_len", lambda c: c.train.seq_len % (2 * c.parallel.cp) == 0,
         lambda c: f"({c.train.seq_len}) must be divisible by 2*cp = {2 * c.parallel.cp} "
         "(each cp rank holds a head and a tail chunk of every sequence)", when=_cp),
    Rule("train.seq_len", lambda c: c.train.seq_len % (c.parallel.cp * c.parallel.tp) == 0,
         lambda c: f"({c.train.seq_len}) must be divisible by cp*tp = "
         f"{c.parallel.cp * c.parallel.tp} under sequence parallelism (each cp rank's chunks split over tp)",
         when=lambda c: _cp(c) and c.parallel.sequence_parallel),
    Rule("parallel.cp", lambda c: _heads(c) % c.parallel.cp == 0,
         lambda c: f"ulysses splits each tp rank's {_heads(c)} heads over cp ({c.parallel.cp}): not divisible",
         when=_ulysses),
    Rule("parallel.cp", lambda c: _kv_heads(c) % c.parallel.cp == 0,
         lambda c: f"ulysses splits each tp rank's {_kv_heads(c)} kv heads over cp ({c.parallel.cp}): not divisible",
         when=_ulysses),
    Rule("parallel.cp", lambda c: c.parallel.tp_mode == "1d",
         lambda c: f"context parallelism composes with 1d tensor parallelism so far "
         f"(not tp_mode '{c.parallel.tp_mode}')", when=_cp),
    Rule("parallel.cp", lambda c: c.parallel.dp_arch == "allreduce",
         "context parallelism is not supported with a parameter server", when=_cp),
    Rule("parallel.cp", lambda c: c.model.sliding_window is None or c.model.sliding_window >= c.train.seq_len,
         lambda c: f"context parallelism computes whole causal attention; model.sliding_window "
         f"({c.model.sliding_window}) is shorter than train.seq_len ({c.train.seq_len})", when=_cp),
    # 'time' runs whole sequences through the blocks before the split, where attention expects chunks
    Rule("parallel.pp_balance", lambda c: c.parallel.pp_balance != "time",
         "'time' is not supported with cp > 1 yet; balance stages by 'layers' or 'params'", when=_cp),
]
