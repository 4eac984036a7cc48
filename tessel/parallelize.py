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
from tessel.models.moe import moe_layers, with_aux_losses
from tessel.parallel.data import data_parallel
from tessel.parallel.expert import moe_metrics, shard_experts
from tessel.train.step import LocalRunner


@dataclass
class Plan:
    """What the steps hand each other: the (local) model and how to score it."""
    model: nn.Module
    loss_fn: Callable = cross_entropy
    full_logits: Callable | None = None  # logits over the whole vocabulary, for sampling
    extra_metrics: Callable[[], dict] | None = None  # per-step metrics for the trainer's row


def _not_yet(cfg: Config) -> None:
    p = cfg.parallel
    pending = [("parallel.pp", p.pp > 1),
               ("parallel.zero_stage", p.zero_stage > 0), ("parallel.recompute", p.recompute)]
    for name, on in pending:
        if on:
            raise NotImplementedError(f"{name} is not implemented yet")


def apply_tensor_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """Megatron TP (and sequence parallelism) from the GPT's plan; the loss becomes vocab-parallel."""
    if mesh.size("tp") == 1:
        return plan
    from tessel.models.plan import GPT_TP_PLAN
    from tessel.parallel.tensor import FullLogits, TPContext, VocabParallelLoss, apply_plan
    if cfg.model.n_experts:
        raise NotImplementedError("parallel.tp with MoE blocks (model.n_experts > 0) is not implemented yet")
    ctx = TPContext.from_mesh(mesh, cfg.parallel.sequence_parallel)
    apply_plan(plan.model, GPT_TP_PLAN, ctx)
    plan.loss_fn = VocabParallelLoss(ctx, cfg.model.vocab_size)
    plan.full_logits = FullLogits(plan.model, ctx, cfg.model.vocab_size, cfg.model.max_seq_len)
    return plan


def apply_expert_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """MoE models (any ep): aux losses join the loss, routing stats the metrics; ep > 1 shards experts."""
    if cfg.model.n_experts == 0:
        return plan
    layers = shard_experts(plan.model, mesh) if mesh.size("ep") > 1 else moe_layers(plan.model)
    plan.loss_fn = with_aux_losses(plan.loss_fn, plan.model)
    plan.extra_metrics = lambda: moe_metrics(layers, mesh)
    return plan


def apply_recompute(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    return plan  # issue 4


def apply_data_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    if mesh.size("dp", "ep") > 1:
        plan.model = data_parallel(plan.model, mesh, axes=("dp", "ep"), bucket_mb=cfg.parallel.bucket_mb)
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
                       max_seq_len=cfg.model.max_seq_len, extra_metrics=plan.extra_metrics)
