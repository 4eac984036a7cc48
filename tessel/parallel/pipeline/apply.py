"""The pipeline's apply step: choose the stage layout, cut this rank's chunks, build the runner.

tessel.apply calls `pipeline_chunks` (the PP split, after TP and EP) and
then `pipeline_runner` (which wraps the chunks in dp or ZeRO and hands back a
tessel.parallel.runner.Runner). Both take the model's ModelParts: the reference
GPT's, or a Hugging Face family's (tessel.models.hf.families).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.axes import TOKEN_AXES
from tessel.config import Config
from tessel.mesh import Mesh
from tessel.models.parts import GPT_PARTS, ModelParts
from tessel.parallel.adamw import adamw
from tessel.parallel.data.reducer import dp_reducer
from tessel.parallel.pipeline.grad_sync import GradientSync, TiedEmbedding
from tessel.parallel.pipeline.partition import balanced_layout, param_costs, split_model, time_costs, uniform_layout
from tessel.parallel.pipeline.runner import PipelineRunner
from tessel.parallel.pipeline.schedules import Placement, is_vshape
from tessel.parallel.pipeline.spec import PipelineSpec
from tessel.parallel.tensor_nd.apply import activation_shards
from tessel.parallel.zero.optim import ZeroAdamW
from tessel.parallel.zero.pipeline import pipeline_zero3
from tessel.parallel.zero.zero_parallel import zero_parallel
from tessel.sharding import mark_replica


def choose_layout(model: nn.Module, mesh: Mesh, cfg: Config, parts: ModelParts = GPT_PARTS) -> list[int]:
    """Blocks per virtual stage: the user's layout, equal counts, or balanced costs (measured time: the
    reference GPT only, tessel.config refuses it for Hugging Face models)."""
    p = cfg.parallel
    stages = p.pp * p.virtual_stages
    if p.pp_layout is not None:
        return list(p.pp_layout)
    if p.pp_balance == "layers":
        return uniform_layout(cfg.model.n_layer, stages)
    if p.pp_balance == "params":
        blocks, head, tail = param_costs(model, parts)
    else:
        micro = cfg.train.global_batch // (p.batch_shards * cfg.train.grad_accum * p.micro_batches)
        blocks, head, tail = time_costs(model, micro, cfg.train.seq_len, mesh.device)
        # ranks time differently; they must agree on one cut, so take the mean
        costs = torch.tensor([*blocks, head, tail], dtype=torch.float64, device=mesh.device)
        if dist.is_initialized():
            dist.all_reduce(costs)
        *blocks, head, tail = (costs / max(1, mesh.world_size)).tolist()
    return balanced_layout(blocks, stages, head, tail)


def pipeline_chunks(model: nn.Module, mesh: Mesh, cfg: Config, parts: ModelParts = GPT_PARTS) -> nn.ModuleList:
    """This rank's model chunks (one per virtual stage it runs)."""
    layout = choose_layout(model, mesh, cfg, parts)
    shards = mesh.size("tp") if cfg.parallel.sequence_parallel else 1  # stages exchange sequence shards
    return nn.ModuleList(split_model(model, layout, mesh.coord("pp"), mesh.size("pp"), parts,
                                     vshape=is_vshape(cfg.parallel.schedule), sequence_shards=shards))


def pipeline_runner(chunks: nn.ModuleList, loss_fn, mesh: Mesh, cfg: Config, gather_vocab=None,
                    extra_metrics=None, param_groups: list[dict] | None = None,
                    parts: ModelParts = GPT_PARTS, stage_losses=None) -> PipelineRunner:
    """param_groups: the chunks' AdamW groups, for ZeRO's optimizer (tessel.train.optim.param_groups);
    parts: where the tied embedding and head live; stage_losses: one aux.StageLoss per chunk (default:
    each chunk's MoE aux losses)."""
    p, t = cfg.parallel, cfg.train
    reducer = dp_reducer(p.dp_algorithm, mesh.world_size, cfg.runtime) if mesh.size(*TOKEN_AXES) > 1 else None
    zero = optimizer = None
    placement = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"), is_vshape(p.schedule))
    if cfg.model.tie_embeddings:  # before ZeRO cuts the head into segments: they inherit the mark
        for c, chunk in enumerate(chunks):
            if placement.is_last(c):  # the first stage's copy is the one the norm counts
                mark_replica(chunk.get_parameter(parts.tied[1]))
    if p.zero_stage == 3:  # whole parameters for a step, shards at rest (tessel.parallel.zero.pipeline)
        zero = pipeline_zero3(chunks, mesh, axes=TOKEN_AXES, bucket_mb=p.bucket_mb)
        optimizer = ZeroAdamW(zero, param_groups, lr=t.lr, betas=(t.beta1, t.beta2))
    elif p.zero_stage:  # ZeRO 1/2 over all of this rank's chunks; the runner syncs on its last backward
        zero, optimizer = zero_parallel(chunks, mesh, p.zero_stage, param_groups, lr=t.lr, betas=(t.beta1, t.beta2),
                                        axes=TOKEN_AXES, bucket_mb=p.bucket_mb, chunks=True)
    tied = TiedEmbedding(mesh, chunks, placement, parts) if cfg.model.tie_embeddings else None
    sync = GradientSync(chunks, mesh, zero=zero, tied=tied, reducer=reducer, bucket_mb=p.bucket_mb)
    spec = PipelineSpec(p.schedule, t.grad_accum * p.micro_batches, cfg.model.d_model, loss_fn, t.precision,
                        seq_shards=mesh.size("tp") if p.sequence_parallel else 1, grid_shards=activation_shards(p.tp_mode, p.tp, p.tp_depth),
                        vocab_size=cfg.model.vocab_size,
                        max_seq_len=cfg.model.max_seq_len, gather_vocab=gather_vocab, extra_metrics=extra_metrics,
                        stage_losses=None if stage_losses is None else tuple(stage_losses), blocks=parts.blocks)
    micro = None
    if p.schedule == "pipedream":  # the stage updates after every micro-batch (async_executor.py)
        micro = adamw(param_groups or [{"params": list(chunks.parameters())}], lr=t.lr, betas=(t.beta1, t.beta2))
    return PipelineRunner(chunks, mesh, spec, sync, optimizer, micro_optimizer=micro, vertical_sync=p.vertical_sync)
