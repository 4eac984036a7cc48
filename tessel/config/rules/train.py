"""The batch and the schedule of a step: the global batch splits over the batch shards, accumulation and
micro-batches; sequences fit the model; the learning rate decays and warms up within the run."""

from __future__ import annotations

from tessel.config.rule import Rule


def _split(c) -> int:
    p, t = c.parallel, c.train
    return p.batch_shards * t.grad_accum * p.micro_batches


RULES = [
    Rule("train.global_batch", lambda c: c.train.global_batch % _split(c) == 0,
         lambda c: f"({c.train.global_batch}) must be divisible by dp*ep*grad_accum*micro_batches = {_split(c)}"),
    Rule("train.seq_len", lambda c: c.train.seq_len <= c.model.max_seq_len,
         lambda c: f"({c.train.seq_len}) exceeds model.max_seq_len ({c.model.max_seq_len})"),
    Rule("train.min_lr", lambda c: c.train.min_lr <= c.train.lr, "must not exceed train.lr"),
    Rule("train.warmup_steps", lambda c: c.train.warmup_steps <= c.train.steps,
         lambda c: f"must not exceed train.steps ({c.train.steps})"),
]
