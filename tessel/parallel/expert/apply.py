"""Expert parallelism's apply step, after TP and CP in tessel.apply's order: MoE models (any ep).

tessel's own MoE blocks (tessel.models.moe): their aux losses join the loss,
their routing statistics the metrics, and ep > 1 shards their experts
(expert_parallel.py). A family whose experts its base_model_ep_plan names (a
transformers MoE: tessel.models.family) keeps its own routers: ep > 1 shards the
experts modules under their own names (hf_experts.py; tessel.config refuses a
model whose experts it cannot place), and its router loss, when its config
outputs router logits, joins the loss. Under cp the balance statistics and the
capacity are those of the whole sequences (tessel.parallel.context.moe); under pp
each stage adds its own share (tessel.parallel.pipeline.apply).
"""

from __future__ import annotations

from functools import partial

from tessel.config import ParallelConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.models.hf.moe import with_router_loss
from tessel.models.moe import bias_routers, moe_layers, with_aux_losses
from tessel.parallel.context.moe import whole_sequence_capacity
from tessel.parallel.expert.balance import (BiasUpdate, balance_over_batch, balance_over_sequences, global_balance,
                                            sequence_balance)
from tessel.parallel.expert.expert_parallel import moe_metrics, shard_experts
from tessel.parallel.expert.hf_experts import shard_hf_experts
from tessel.parallel.plan import Plan


def apply_expert_parallel(plan: Plan, mesh: Mesh, parallel: ParallelConfig, family: ModelFamily, n_experts: int,
                          aux_loss_scope: str, grad_accum: int) -> Plan:
    """MoE models (any ep): aux losses join the loss, routing stats the metrics; ep > 1 shards experts."""
    if family.experts_by_plan:  # whatever tessel's shape fields say: the model's own routers decide
        return _experts_by_plan(plan, mesh, family, aux_loss_scope)
    if n_experts == 0:
        return plan
    layers = shard_experts(plan.model, mesh) if mesh.size("ep") > 1 else moe_layers(plan.model)
    if aux_loss_scope == "global":  # under a GPipe pipeline: the whole step's statistics
        gpipe = mesh.size("pp") > 1 and parallel.schedule == "gpipe"
        balance_over_batch(plan.model, mesh, grad_accum * parallel.micro_batches if gpipe else None)
    elif plan.cp is not None:  # local: a rank's shard of the batch, its sequences whole over cp
        balance_over_sequences(plan.model, mesh)
    if plan.cp is not None:  # capacity of the whole sequences (tessel.parallel.context.moe)
        whole_sequence_capacity(plan.model, plan.cp)
    if bias_routers(plan.model):  # DeepSeek-V3's bias balancing, after each optimizer step
        plan.after_update.append(BiasUpdate(plan, mesh))
    if mesh.size("pp") > 1:  # the pipeline adds each stage's aux losses itself (pipeline/aux.py)
        layers = []  # the stats of this rank's blocks are chosen once the model is split
    else:
        plan.loss_terms.append(partial(with_aux_losses, model=plan.model))
    plan.extra_metrics = lambda: moe_metrics(layers, mesh)
    return plan


def _experts_by_plan(plan: Plan, mesh: Mesh, family: ModelFamily, aux_loss_scope: str) -> Plan:
    """A transformers MoE: ep > 1 shards the experts its base_model_ep_plan names; the router loss of any MoE
    family (as transformers adds it: tessel.models.hf.moe) joins the loss."""
    if mesh.size("ep") > 1:
        shard_hf_experts(plan.model, mesh)
    if mesh.size("pp") > 1:  # its loss spans every layer: each stage adds its share (apply_pipeline)
        return plan
    loss = family.router_loss(plan.model)
    if loss is not None:  # under cp its statistics span the cp ranks too (tessel.parallel.context.moe)
        loss.balance = global_balance(mesh) if aux_loss_scope == "global" else sequence_balance(mesh)
        plan.loss_terms.append(partial(with_router_loss, router_loss=loss))
    return plan
