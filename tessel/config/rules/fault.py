"""Fault tolerance (tessel.train.fault): re-planning and slow-rank policies act on a device mesh (not the
parameter server's layout), and a stalled rank is told from a late heartbeat."""

from __future__ import annotations

from tessel.config.rule import Rule

RULES = [
    Rule("fault.replan", lambda c: c.fault.replan == "dp-only" or c.parallel.dp_arch == "allreduce",
         "'full' re-plans a device mesh; the parameter server (dp_arch = 'ps') keeps its layout"),
    Rule("fault.slow_policy", lambda c: c.fault.slow_policy == "warn" or c.parallel.dp_arch == "allreduce",
         "rebalance and evict act on a device mesh; the parameter server has its own straggler rules"),
    Rule("fault.slow_policy", lambda c: c.fault.slow_policy == "warn" or c.parallel.zero_stage == 0
         or (c.parallel.ep == 1 and c.parallel.pp == 1),
         "rebalance and evict continue from a checkpoint, which ZeRO with ep or pp cannot write yet"),
    Rule("fault.hang_timeout_s",
         lambda c: c.fault.heartbeat_s == 0 or c.fault.hang_timeout_s >= 2 * c.fault.heartbeat_s,
         lambda c: f"must be at least twice fault.heartbeat_s ({c.fault.heartbeat_s})"),
]
