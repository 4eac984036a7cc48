"""Apply a parallel layout to the reference GPT, in a fixed order.

TP/SP -> EP -> PP split -> recompute -> DP/ZeRO. Each step reads the mesh and
the parallel config and leaves the model a plain module to the next one; the
model file itself never imports tessel.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from tessel.config import Config
from tessel.mesh import Mesh
from tessel.models.gpt import GPT, cross_entropy
from tessel.parallel.data import data_parallel
from tessel.train.step import LocalRunner


@dataclass
class Plan:
    """What the steps hand each other: the (local) model and how to score it."""
    model: nn.Module
    loss_fn: Callable = cross_entropy
    full_logits: Callable | None = None  # logits over the whole vocabulary, for sampling


def _not_yet(cfg: Config) -> None:
    p = cfg.parallel
    pending = [("parallel.tp", p.tp > 1), ("parallel.pp", p.pp > 1), ("parallel.ep", p.ep > 1),
               ("parallel.zero_stage", p.zero_stage > 0), ("parallel.recompute", p.recompute)]
    for name, on in pending:
        if on:
            raise NotImplementedError(f"{name} is not implemented yet")


def apply_tensor_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    return plan  # issue 3


def apply_expert_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    return plan  # issue 5


def apply_recompute(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    return plan  # issue 4


def apply_data_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    if mesh.size("dp", "ep") > 1:
        from tessel.comm.reducer import dp_reducer
        reducer = dp_reducer(cfg.parallel.dp_algorithm, mesh.world_size, cfg.runtime)
        plan.model = data_parallel(plan.model, mesh, axes=("dp", "ep"), bucket_mb=cfg.parallel.bucket_mb,
                                   reducer=reducer)
    return plan


def parallelize(model: GPT, mesh: Mesh, cfg: Config):
    """Returns a runner (see tessel.train.step) that owns the parallelized model."""
    _not_yet(cfg)
    plan = Plan(model, cross_entropy, model)
    plan = apply_tensor_parallel(plan, mesh, cfg)
    plan = apply_expert_parallel(plan, mesh, cfg)
    # pipeline parallelism (issue 4) returns its own runner from here
    plan = apply_recompute(plan, mesh, cfg)
    plan = apply_data_parallel(plan, mesh, cfg)
    chunks = cfg.train.grad_accum * cfg.parallel.micro_batches
    return LocalRunner(plan.model, plan.loss_fn, chunks, mesh.device, cfg.train.precision,
                       full_logits=plan.full_logits, vocab_size=cfg.model.vocab_size,
                       max_seq_len=cfg.model.max_seq_len)
