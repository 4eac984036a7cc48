"""Processes and devices: the backend against the device, the topology file, the emulated accelerator (the
reference GPT's blocks only), and the nodes the ranks span."""

from __future__ import annotations

from pathlib import Path

from tessel.config.rule import Rule

RULES = [
    Rule("runtime.backend", lambda c: not (c.runtime.backend == "nccl" and c.runtime.device == "cpu"),
         "nccl needs runtime.device = 'cuda'"),
    Rule("runtime.topology", lambda c: Path(c.runtime.topology).is_file(),
         lambda c: f"no such file: {c.runtime.topology}", when=lambda c: c.runtime.topology is not None),
    Rule("runtime.emulate_flops", lambda c: c.runtime.emulate_flops is None or c.model.hf_config is None,
         "emulates the reference GPT's blocks; not a Hugging Face model"),
]


def _nodes(c) -> int:
    return c.runtime.nnodes * c.runtime.nproc_per_node


NODES = [
    Rule("runtime.nproc_per_node", lambda c: _nodes(c) == c.parallel.world_size,
         lambda c: f"nnodes*nproc_per_node = {_nodes(c)} but pp*dp*ep*cp*tp (+ ps_servers) "
         f"= {c.parallel.world_size}", when=lambda c: c.runtime.nproc_per_node is not None),
]
