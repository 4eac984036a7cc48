"""Apply a parallel layout to a model (the reference GPT or a Hugging Face one), in a fixed order.

The trainer calls `parallelize(model, mesh, cfg)` here; a user's own loop calls the
public `tessel.parallelize(model, mesh, layout)` (tessel.api), which builds the same
config and calls it.

TP/SP -> CP -> EP -> PP split -> fused loss -> float8 -> recompute -> compile -> DP/ZeRO, with
and without a pipeline. Each step lives in its strategy's folder
(tessel/parallel/<strategy>/apply.py; recompute and compile in their modules),
takes the Plan (tessel.parallel.plan), the mesh and its config sections, and
leaves the model a plain module (or a pipeline rank's chunks) to the next one. What
differs between the reference GPT and a Hugging Face family is asked of the model's
family (tessel.models.family). Here: the order, and the runner the plan ends in.
"""

from __future__ import annotations

import torch.nn as nn

from tessel.config import Config
from tessel.mesh import Mesh
from tessel.models.family import model_family
from tessel.models.gpt import cross_entropy
from tessel.parallel.compile import apply_compile
from tessel.parallel.context.apply import apply_context_parallel, whole_sequences
from tessel.parallel.data.apply import apply_data_parallel
from tessel.parallel.data.uneven import loss_weight
from tessel.parallel.expert.apply import apply_expert_parallel
from tessel.parallel.float8.apply import apply_float8
from tessel.parallel.fused_loss.apply import apply_fused_loss
from tessel.parallel.pipeline.apply import apply_pipeline, pipeline_runner
from tessel.parallel.plan import Plan
from tessel.parallel.recompute import apply_recompute
from tessel.parallel.runner import LocalRunner
from tessel.parallel.tensor.apply import apply_tensor_parallel
from tessel.parallel.tensor_nd.apply import apply_tensor_grid
from tessel.parallel.zero.apply import apply_zero


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config):
    """Returns a runner (see tessel.parallel.runner) that owns the parallelized model."""
    if cfg.parallel.dp_arch == "ps":
        raise ValueError("parallel.dp_arch = 'ps' trains through tessel.train.ps.trainer (servers are extra ranks)")
    p, m, t, family = cfg.parallel, cfg.model, cfg.train, model_family(cfg.model)
    plan = Plan(model, cross_entropy, model)
    plan = apply_tensor_parallel(plan, mesh, p, family, m.vocab_size, m.max_seq_len)
    plan = apply_tensor_grid(plan, mesh, p, family, m.vocab_size, m.d_model)
    plan = apply_context_parallel(plan, mesh, p, family)
    plan = apply_expert_parallel(plan, mesh, p, family, m.n_experts, m.aux_loss_scope, t.grad_accum)
    plan = apply_pipeline(plan, mesh, p, t, m, family)
    plan = apply_fused_loss(plan, mesh, p, t.fused_loss, m.vocab_size, m.max_seq_len)
    plan = apply_float8(plan, mesh, t, family)
    plan = apply_recompute(plan, mesh, p.recompute, family)
    plan = apply_compile(plan, mesh, p, t, family)
    plan = apply_zero(plan, mesh, p, t, family)  # DP/ZeRO: one door, over the model or a pipeline rank's chunks
    plan = apply_data_parallel(plan, mesh, p, cfg.runtime, family)
    runner = pipeline_runner(plan, mesh, p, t, m) if mesh.size("pp") > 1 else _local_runner(plan, mesh, cfg)
    runner.after_update = tuple(plan.after_update)
    if plan.cp is not None:  # the trainer's samples continue whole prompts: every cp rank runs them whole
        runner.generate = whole_sequences(plan.cp, runner.generate)
    return runner


def _local_runner(plan: Plan, mesh: Mesh, cfg: Config) -> LocalRunner:
    """Without a pipeline: the model's micro-batches on this rank (this dp rank's share on uneven devices)."""
    p, m = cfg.parallel, cfg.model
    chunks, weight = cfg.train.grad_accum * p.micro_batches, 1.0
    if p.dp_shares is not None:  # heterogeneous devices: this dp rank's share (parallel/data/uneven.py)
        shares, me = p.dp_shares, mesh.coord("dp")
        chunks, weight = shares[me], loss_weight(shares, me)
    return LocalRunner(plan.model, plan.loss(), chunks, mesh.device, cfg.train.precision,
                       full_logits=plan.full_logits, vocab_size=m.vocab_size, max_seq_len=m.max_seq_len,
                       extra_metrics=plan.extra_metrics, optimizer=plan.optimizer, loss_weight=weight)
