"""The pipeline's apply step: choose the stage layout, cut this rank's chunks; and the runner they train in.

tessel.apply calls `apply_pipeline` after TP, CP and EP: the model becomes this
rank's chunks, cut by the module names of the model family's parts (the
reference GPT's, or a Hugging Face family's: tessel.models.family). The steps
after it (fused loss, recompute, compile, DP/ZeRO) work on the chunks; then
`pipeline_runner` builds a tessel.parallel.runner.Runner from what they handed
on: the chunks' DataParallel wrappers or ZeRO engine (tessel.parallel.data.apply,
tessel.parallel.zero.apply) and ZeRO's optimizer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.config import ModelConfig, ParallelConfig, TrainConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily, StageSequence
from tessel.models.hf.moe import RouterLossSpec
from tessel.models.moe import moe_layers
from tessel.models.parts import GPT_PARTS, ModelParts
from tessel.parallel.adamw import adamw
from tessel.parallel.expert.cross_stage import stage_router_losses
from tessel.parallel.expert.expert_parallel import moe_metrics
from tessel.parallel.pipeline.grad_sync import GradientSync, TiedEmbedding
from tessel.parallel.pipeline.partition import balanced_layout, param_costs, split_model, time_costs, uniform_layout
from tessel.parallel.pipeline.runner import PipelineRunner
from tessel.parallel.pipeline.schedules import Placement, is_vshape
from tessel.parallel.pipeline.spec import PipelineSpec
from tessel.parallel.plan import Plan
from tessel.parallel.tensor.context import TPContext
from tessel.parallel.tensor.regions import sequence_parallel_stage
from tessel.parallel.tensor_nd.apply import activation_shards
from tessel.parallel.weight_decay import param_groups
from tessel.sharding import mark_replica


def choose_layout(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, n_layer: int,
                  parts: ModelParts = GPT_PARTS) -> list[int]:
    """Blocks per virtual stage: the user's layout, equal counts, or balanced costs (measured time: the
    reference GPT only, tessel.config refuses it for Hugging Face models)."""
    p = parallel
    stages = p.pp * p.virtual_stages
    if p.pp_layout is not None:
        return list(p.pp_layout)
    if p.pp_balance == "layers":
        return uniform_layout(n_layer, stages)
    if p.pp_balance == "params":
        blocks, head, tail = param_costs(model, parts)
    else:
        micro = train.global_batch // (p.batch_shards * train.grad_accum * p.micro_batches)
        blocks, head, tail = time_costs(model, micro, train.seq_len, mesh.device)
        # ranks time differently; they must agree on one cut, so take the mean
        costs = torch.tensor([*blocks, head, tail], dtype=torch.float64, device=mesh.device)
        if dist.is_initialized():
            dist.all_reduce(costs)
        *blocks, head, tail = (costs / max(1, mesh.world_size)).tolist()
    return balanced_layout(blocks, stages, head, tail)


def pipeline_chunks(model: nn.Module, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, n_layer: int,
                    parts: ModelParts = GPT_PARTS) -> nn.ModuleList:
    """This rank's model chunks (one per virtual stage it runs)."""
    layout = choose_layout(model, mesh, parallel, train, n_layer, parts)
    shards = mesh.size("tp") if parallel.sequence_parallel else 1  # stages exchange sequence shards
    return nn.ModuleList(split_model(model, layout, mesh.coord("pp"), mesh.size("pp"), parts,
                                     vshape=is_vshape(parallel.schedule), sequence_shards=shards))


def apply_pipeline(plan: Plan, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, model_cfg: ModelConfig,
                   family: ModelFamily) -> Plan:
    """pp > 1: the model becomes this rank's stage chunks (original parameter names kept), cut by the
    module names of its family's parts."""
    if mesh.size("pp") == 1:
        return plan
    plan.parts = family.pipeline_parts(plan.model)
    plan.model = pipeline_chunks(plan.model, mesh, parallel, train, model_cfg.n_layer, plan.parts)
    plan.full_logits = None
    stage = family.stage_sequence(plan.parts)
    if parallel.sequence_parallel and stage is not None:
        _sequence_parallel_stages(plan.model, mesh, stage, family)
    spec = family.router_loss_spec(plan.model[0])
    if spec is not None:
        plan.stage_losses = _router_stage_losses(plan.model, mesh, parallel, train.grad_accum,
                                                 model_cfg.aux_loss_scope, spec)
    if model_cfg.n_experts:  # routing stats of the MoE blocks this rank holds
        local = moe_layers(plan.model)
        plan.extra_metrics = lambda: moe_metrics(local, mesh)
    if model_cfg.tie_embeddings:  # before ZeRO cuts the head into segments: they inherit the mark
        _mark_tied_head(plan.model, mesh, parallel, plan.parts)
    return plan


def _mark_tied_head(chunks: nn.ModuleList, mesh: Mesh, parallel: ParallelConfig, parts: ModelParts) -> None:
    """The last stage's copy of a tied embedding is a replica: the first stage's is the one the norm counts."""
    placement = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"), is_vshape(parallel.schedule))
    for c, chunk in enumerate(chunks):
        if placement.is_last(c):
            mark_replica(chunk.get_parameter(parts.tied[1]))


def _sequence_parallel_stages(chunks: nn.ModuleList, mesh: Mesh, stage: StageSequence, family: ModelFamily) -> None:
    """tp + SP under pp on a model that measures its sequence from its input (GPT-2's own parts): a stage after
    the first makes the sequence shard it receives whole and its first layer splits it again; one before the
    last of a family that reshapes at its final norm (GPT-2) makes the sequence whole there and sends its
    shard."""
    ctx = TPContext.from_mesh(mesh, sequence_parallel=True)
    place = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"))
    for c, chunk in enumerate(chunks):
        reshapes = stage.final_norm is not None and not place.is_last(c)
        whole_at = chunk.get_submodule(stage.final_norm) if reshapes else None
        sequence_parallel_stage(chunk, ctx, None if place.is_first(c) else stage.hidden_input,
                                family.decoder_layers(chunk)[0], whole_at)


def _router_stage_losses(chunks: nn.ModuleList, mesh: Mesh, parallel: ParallelConfig, grad_accum: int, scope: str,
                         spec: RouterLossSpec) -> list:
    """A Hugging Face MoE's router loss over every layer, each stage back-propagating its share (parallel/expert/
    cross_stage.py): over the whole step under GPipe with the global scope, per micro-batch otherwise."""
    place = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"))
    return stage_router_losses(chunks, mesh, spec, scope, grad_accum * parallel.micro_batches,
                               scope == "global" and parallel.schedule == "gpipe",
                               [place.is_last(c) for c in range(len(chunks))])


def pipeline_runner(plan: Plan, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig,
                    model_cfg: ModelConfig) -> PipelineRunner:
    """The runner of this rank's chunks as the steps left them: plan.zero or plan.chunk_dp reduce their gradients
    (the DP/ZeRO step's), plan.optimizer is ZeRO's (None: the trainer's AdamW); plan.parts says where the tied
    embedding and head live; plan.stage_losses: one aux.StageLoss per chunk (default: each chunk's MoE aux
    losses)."""
    chunks = plan.model
    placement = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"), is_vshape(parallel.schedule))
    tied = TiedEmbedding(mesh, chunks, placement, plan.parts) if model_cfg.tie_embeddings else None
    sync = GradientSync(chunks, zero=plan.zero, tied=tied, dp=plan.chunk_dp)
    spec = PipelineSpec(parallel.schedule, train.grad_accum * parallel.micro_batches, model_cfg.d_model, plan.loss(),
                        train.precision, seq_shards=mesh.size("tp") if parallel.sequence_parallel else 1,
                        grid_shards=activation_shards(parallel.tp_mode, mesh.size("tp"), parallel.tp_depth),
                        vocab_size=model_cfg.vocab_size, max_seq_len=model_cfg.max_seq_len,
                        gather_vocab=plan.gather_vocab, extra_metrics=plan.extra_metrics,
                        stage_losses=None if plan.stage_losses is None else tuple(plan.stage_losses),
                        blocks=plan.parts.blocks)
    micro = None
    if parallel.schedule == "pipedream":  # the stage updates after every micro-batch (async_executor.py)
        micro = adamw(param_groups(chunks.parameters(), train.weight_decay), lr=train.lr,
                      betas=(train.beta1, train.beta2))
    return PipelineRunner(chunks, mesh, spec, sync, plan.optimizer, micro_optimizer=micro,
                          vertical_sync=parallel.vertical_sync)
