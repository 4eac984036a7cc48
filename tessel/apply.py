"""Apply a parallel layout to a model (the reference GPT or a Hugging Face one), in a fixed order.

The trainer calls `parallelize(model, mesh, cfg)` here; a user's own loop calls the
public `tessel.parallelize(model, mesh, layout)` (tessel.api), which builds the same
config and calls it.

TP/SP -> CP -> EP -> PP split -> fused loss -> recompute -> compile -> DP/ZeRO. Each step reads the mesh and
the parallel config and leaves the model a plain module to the next one; the
model file itself never imports tessel.parallel.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch.nn as nn

from tessel.axes import TOKEN_AXES
from tessel.config import Config
from tessel.mesh import Mesh
from tessel.models.build import uses_every_parameter
from tessel.models.gpt import Block, cross_entropy
from tessel.models.hf.families import Family, decoder_layers, family_of, pipeline_parts, tp_rules
from tessel.models.hf.tp_plan import PlanNotes, hf_tp_plan, rules_from_plan
from tessel.hf_shape import read_config
from tessel.models.hf.moe import RouterLossSpec, router_loss, router_loss_spec, with_router_loss
from tessel.models.moe import MoE, moe_layers, with_aux_losses
from tessel.models.parts import GPT_PARTS, ModelParts
from tessel.models.plan import gpt_tp_plan
from tessel.parallel.context.apply import context_parallel, whole_sequences
from tessel.parallel.context.context import CPContext
from tessel.parallel.context.moe import whole_sequence_capacity
from tessel.parallel.data.data_parallel import data_parallel
from tessel.parallel.data.reducer import dp_reducer
from tessel.parallel.data.unused import mark_always_used
from tessel.parallel.data.uneven import loss_weight
from tessel.parallel.expert.balance import (balance_over_batch, balance_over_sequences, global_balance,
                                            sequence_balance)
from tessel.parallel.expert.cross_stage import stage_router_losses
from tessel.parallel.expert.hf_experts import shard_hf_experts
from tessel.parallel.expert.expert_parallel import moe_metrics, shard_experts
from tessel.parallel.fused_loss.apply import FusedHead, GatherAfterHead, LogitsOf, fuse_model_head
from tessel.parallel.pipeline.apply import pipeline_chunks, pipeline_runner
from tessel.parallel.pipeline.schedules import Placement, is_vshape
from tessel.parallel.compile import compile_for_training
from tessel.parallel.recompute import recompute_attention_cores, recompute_blocks
from tessel.parallel.runner import LocalRunner
from tessel.parallel.tensor.regions import refuse_own_loss, sequence_parallel_stage
from tessel.parallel.tensor.tensor_parallel import FullLogits, GatherVocab, TPContext, VocabParallelLoss, apply_plan
from tessel.parallel.tensor_nd.apply import apply_grid_mode
from tessel.parallel.zero.zero_parallel import zero_dtypes, zero_parallel
from tessel.train.optim import param_groups


@dataclass
class Plan:
    """What the steps hand each other: the (local) model and how to score it."""
    model: nn.Module
    loss_fn: Callable = cross_entropy
    full_logits: Callable | None = None  # logits over the whole vocabulary, for sampling
    optimizer: object | None = None  # a strategy that shards the optimizer (ZeRO) supplies it
    extra_metrics: Callable[[], dict] | None = None  # per-step metrics for the trainer's row
    gather_vocab: Callable | None = None  # vocab-sharded logits -> full (a pipeline's last stage samples)
    parts: ModelParts = GPT_PARTS  # where a pipeline cuts the model (a Hugging Face family's, or the GPT's)
    cp: CPContext | None = None  # context parallelism's attention: generation switches it to whole sequences
    stage_losses: list | None = None  # a pipeline chunk's part of a loss that spans stages (an HF MoE's router loss)
    # what joins the head's loss (MoE aux losses, an HF MoE's router loss): each wraps the loss it is given, once
    # the head's loss is final (apply_fused_loss replaces it after the steps that add these)
    loss_terms: list[Callable[[Callable], Callable]] = field(default_factory=list)
    fused: FusedHead | None = None  # train.fused_loss: the head whose matmul moved into the loss

    def loss(self) -> Callable:
        """The head's loss with what joins it."""
        loss = self.loss_fn
        for term in self.loss_terms:
            loss = term(loss)
        return loss


def apply_tensor_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """Megatron TP (and sequence parallelism) from the model's plan; the loss becomes vocab-parallel.

    The reference GPT's plan is tessel.models.plan's; a Hugging Face model's is derived from its config's
    base_model_tp_plan and its family's rules (tessel.models.hf.tp_plan), and must place every parameter.
    """
    if mesh.size("tp") == 1:
        return plan
    if cfg.parallel.tp_mode != "1d":
        return _apply_grid_mode(plan, mesh, cfg)
    ctx = TPContext.from_mesh(mesh, cfg.parallel.sequence_parallel)
    if cfg.model.hf_config is None:
        moe_blocks = [i for i, layer in enumerate(plan.model.layers) if isinstance(layer.mlp, MoE)]
        apply_plan(plan.model, gpt_tp_plan(moe_blocks, cfg.model.n_layer), ctx)
    else:
        hf_plan = hf_tp_plan(plan.model, tp_rules(plan.model, _family(cfg)))
        apply_plan(plan.model, hf_plan.styles, ctx, place_all=True, widths=hf_plan.widths, blocks=hf_plan.blocks)
        refuse_own_loss(plan.model)  # its loss on vocab-sharded logits would be wrong
    plan.loss_fn = VocabParallelLoss(ctx, cfg.model.vocab_size)
    plan.full_logits = FullLogits(plan.model, ctx, cfg.model.vocab_size, cfg.model.max_seq_len)
    plan.gather_vocab = GatherVocab(ctx)
    return plan


def _apply_grid_mode(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """tp_mode 2d / 2.5d / 3d (tessel.parallel.tensor_nd): the model's TP plan (the reference GPT's, or a Hugging
    Face family's, derived from transformers' plan as it is declared), its modules made grid layers."""
    p, m = cfg.parallel, cfg.model
    if m.hf_config is None:
        styles = gpt_tp_plan([], m.n_layer)
    else:
        # without the family's notes: they split a fused projection by heads over 1D's ranks (Phi-3's), where the
        # grid takes the plan's own gathered output (its blocks' checkpoint layout on a grid is not built)
        styles = hf_tp_plan(plan.model, rules_from_plan(plan.model, PlanNotes())).styles
        refuse_own_loss(plan.model)  # its loss on the grid's logits would be wrong
    done = apply_grid_mode(plan.model, styles, mesh, p.tp_mode, p.tp_depth, m.vocab_size, m.d_model)
    plan.loss_fn, plan.full_logits, plan.gather_vocab = done.loss_fn, done.full_logits, done.gather_vocab
    return plan


def _family(cfg: Config) -> Family | None:
    """The Hugging Face family of the model (tessel.models.hf.families: its entry, or one read from its plans)."""
    return family_of(read_config(cfg.model.hf_config)["model_type"])


def apply_context_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """cp > 1 (tessel.parallel.context): attention over the whole sequence from each rank's chunks, rotary at
    each rank's own positions. Weights stay whole: their gradients are averaged over cp like dp's (TOKEN_AXES)."""
    if mesh.size("cp") > 1:
        plan.cp = context_parallel(plan.model, mesh, cfg.parallel.cp_mode, hf=cfg.model.hf_config is not None)
    return plan


def apply_expert_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """MoE models (any ep): aux losses join the loss, routing stats the metrics; ep > 1 shards experts."""
    if cfg.model.hf_config is not None:  # whatever tessel's shape fields say: the model's own routers decide
        return _hf_expert_parallel(plan, mesh, cfg)
    if cfg.model.n_experts == 0:
        return plan
    layers = shard_experts(plan.model, mesh) if mesh.size("ep") > 1 else moe_layers(plan.model)
    if cfg.model.aux_loss_scope == "global":  # under a GPipe pipeline: the whole step's statistics
        gpipe = mesh.size("pp") > 1 and cfg.parallel.schedule == "gpipe"
        balance_over_batch(plan.model, mesh, cfg.train.grad_accum * cfg.parallel.micro_batches if gpipe else None)
    elif plan.cp is not None:  # local: a rank's shard of the batch, its sequences whole over cp
        balance_over_sequences(plan.model, mesh)
    if plan.cp is not None:  # capacity of the whole sequences (tessel.parallel.context.moe)
        whole_sequence_capacity(plan.model, plan.cp)
    if mesh.size("pp") > 1:  # the pipeline adds each stage's aux losses itself (pipeline/aux.py)
        layers = []  # the stats of this rank's blocks are chosen once the model is split
    else:
        plan.loss_terms.append(partial(with_aux_losses, model=plan.model))
    plan.extra_metrics = lambda: moe_metrics(layers, mesh)
    return plan


def _hf_expert_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """A Hugging Face model: ep > 1 shards the experts its base_model_ep_plan names, under their own names
    (tessel.parallel.expert.hf_experts; tessel.config refuses a model whose experts it cannot place); the router
    loss of any MoE family (when its config outputs router logits, as transformers adds it: tessel.models.hf.moe)
    joins the loss."""
    if mesh.size("ep") > 1:
        shard_hf_experts(plan.model, mesh)
    if mesh.size("pp") > 1:  # its loss spans every layer: each stage adds its share (apply_pipeline)
        return plan
    loss = router_loss(plan.model)
    if loss is not None:  # under cp its statistics span the cp ranks too (tessel.parallel.context.moe)
        loss.balance = global_balance(mesh) if cfg.model.aux_loss_scope == "global" else sequence_balance(mesh)
        plan.loss_terms.append(partial(with_router_loss, router_loss=loss))
    return plan


def apply_pipeline(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """pp > 1: the model becomes this rank's stage chunks (original parameter names kept), cut by the
    module names of its parts: the reference GPT's, or its Hugging Face family's."""
    if mesh.size("pp") > 1:
        if cfg.model.hf_config is not None:
            plan.parts = pipeline_parts(plan.model, _family(cfg))
        plan.model = pipeline_chunks(plan.model, mesh, cfg, plan.parts)
        plan.full_logits = None
        # stages that hand over at the blocks exchange sequence shards as they are (pipeline/handover.py)
        if cfg.model.hf_config is not None and cfg.parallel.sequence_parallel and not plan.parts.hand_over_at_blocks:
            _hf_sequence_parallel_stages(plan.model, mesh, _family(cfg))
        spec = router_loss_spec(plan.model[0]) if cfg.model.hf_config is not None else None
        if spec is not None:
            plan.stage_losses = _router_stage_losses(plan.model, mesh, cfg, spec)
        if cfg.model.n_experts:  # routing stats of the MoE blocks this rank holds
            local = moe_layers(plan.model)
            plan.extra_metrics = lambda: moe_metrics(local, mesh)
    return plan


def _hf_sequence_parallel_stages(chunks: nn.ModuleList, mesh: Mesh, known: Family) -> None:
    """tp + SP under pp on a Hugging Face model without a pipeline plan (GPT-2's own parts), which measures its
    sequence from its input: a stage after the first makes the sequence shard it receives whole and its first
    layer splits it again; one before the last of a family that reshapes at its final norm (GPT-2) makes the
    sequence whole there and sends its shard."""
    ctx = TPContext.from_mesh(mesh, sequence_parallel=True)
    place = Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"))
    for c, chunk in enumerate(chunks):
        reshapes = known.tp.reshapes_output and not place.is_last(c)
        whole_at = chunk.get_submodule(known.tp.final_norm) if reshapes else None
        sequence_parallel_stage(chunk, ctx, None if place.is_first(c) else known.parts.hidden_input,
                                decoder_layers(chunk, known)[0], whole_at)


def _router_stage_losses(chunks: nn.ModuleList, mesh: Mesh, cfg: Config, spec: RouterLossSpec) -> list:
    """A Hugging Face MoE's router loss over every layer, each stage back-propagating its share (parallel/expert/
    cross_stage.py): over the whole step under GPipe with the global scope, per micro-batch otherwise."""
    p, place = cfg.parallel, Placement(mesh.size("pp"), len(chunks), mesh.coord("pp"))
    scope = cfg.model.aux_loss_scope
    return stage_router_losses(chunks, mesh, spec, scope,
                               cfg.train.grad_accum * p.micro_batches, scope == "global" and p.schedule == "gpipe",
                               [place.is_last(c) for c in range(len(chunks))])


def apply_fused_loss(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """train.fused_loss (tessel.parallel.fused_loss): the head hands out its input and the loss does its matmul,
    chunked over tokens (vocabulary-parallel under tp), so the fp32 logits never exist. After the pipeline's
    cut: only the rank holding the head (the last stage) changes anything. Sampling takes the head's logits from
    its input: the model's whole-vocabulary logits, or a pipeline's last stage through gather_vocab."""
    if not cfg.train.fused_loss:
        return plan
    if mesh.size("pp") > 1:
        place = Placement(mesh.size("pp"), len(plan.model), mesh.coord("pp"), is_vshape(cfg.parallel.schedule))
        last = [chunk for c, chunk in enumerate(plan.model) if place.is_last(c)]
        plan.fused = fuse_model_head(last[0], cfg.model.vocab_size) if last else None
        if plan.fused is not None:  # the last stage samples from its output, sliced to the last position
            plan.loss_fn, plan.gather_vocab = plan.fused.loss, GatherAfterHead(plan.fused, plan.gather_vocab)
        return plan
    plan.fused = fuse_model_head(plan.model, cfg.model.vocab_size)
    plan.loss_fn = plan.fused.loss
    logits = LogitsOf(plan.model, plan.fused)
    plan.full_logits = logits if mesh.size("tp") == 1 else \
        FullLogits(logits, plan.fused.head.ctx, cfg.model.vocab_size, cfg.model.max_seq_len)
    return plan


def apply_recompute(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    if cfg.parallel.recompute == "selective":  # the reference GPT only (tessel.config refuses it for HF models)
        recompute_attention_cores(plan.model.modules())
    elif cfg.parallel.recompute == "full":
        if cfg.model.hf_config is None:
            recompute_blocks([m for m in plan.model.modules() if isinstance(m, Block)])
        else:
            stages = plan.model if mesh.size("pp") > 1 else [plan.model]  # a pipeline rank's chunks
            recompute_blocks([layer for stage in stages for layer in decoder_layers(stage, _family(cfg))])
    return plan


def apply_compile(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    """train.compile (tessel.parallel.compile): each block, or the model (each pipeline chunk), compiled where
    ZeRO's and DP's hooks will wrap it."""
    if cfg.train.compile != "off":
        compile_for_training(list(plan.model) if mesh.size("pp") > 1 else [plan.model], cfg)
    return plan


def apply_data_parallel(plan: Plan, mesh: Mesh, cfg: Config) -> Plan:
    if cfg.parallel.zero_stage > 0:
        t = cfg.train
        plan.model, plan.optimizer = zero_parallel(
            plan.model, mesh, cfg.parallel.zero_stage, param_groups(plan.model.parameters(), t.weight_decay),
            lr=t.lr, betas=(t.beta1, t.beta2), axes=TOKEN_AXES, bucket_mb=cfg.parallel.bucket_mb,
            **zero_dtypes(cfg.parallel))
        if plan.fused is not None:  # ZeRO-3 frees the head after a forward without gradients: gather it to read
            plan.fused.whole = plan.model.root_gathered
        return plan
    if mesh.size(*TOKEN_AXES) > 1:
        reducer = dp_reducer(cfg.parallel.dp_algorithm, mesh.world_size, cfg.runtime)
        plan.model = data_parallel(plan.model, mesh, axes=TOKEN_AXES, bucket_mb=cfg.parallel.bucket_mb,
                                   reducer=reducer)
    return plan


def parallelize(model: nn.Module, mesh: Mesh, cfg: Config):
    """Returns a runner (see tessel.parallel.runner) that owns the parallelized model."""
    if cfg.parallel.dp_arch == "ps":
        raise ValueError("parallel.dp_arch = 'ps' trains through tessel.train.ps_trainer (servers are extra ranks)")
    plan = Plan(model, cross_entropy, model)
    plan = apply_tensor_parallel(plan, mesh, cfg)
    plan = apply_context_parallel(plan, mesh, cfg)
    plan = apply_expert_parallel(plan, mesh, cfg)
    plan = apply_pipeline(plan, mesh, cfg)
    plan = apply_fused_loss(plan, mesh, cfg)
    plan = apply_recompute(plan, mesh, cfg)
    plan = apply_compile(plan, mesh, cfg)
    if uses_every_parameter(cfg.model):  # no step asks which went unused: no host read (parallel/data/unused.py)
        mark_always_used(plan.model.parameters())
    if mesh.size("pp") > 1:
        # the pipeline runner reduces over dp per chunk itself, after each chunk's last backward
        runner = pipeline_runner(plan.model, plan.loss(), mesh, cfg, gather_vocab=plan.gather_vocab,
                                 extra_metrics=plan.extra_metrics,
                                 param_groups=param_groups(plan.model.parameters(), cfg.train.weight_decay),
                                 parts=plan.parts, stage_losses=plan.stage_losses)
    else:
        plan = apply_data_parallel(plan, mesh, cfg)
        chunks, weight = cfg.train.grad_accum * cfg.parallel.micro_batches, 1.0
        if cfg.parallel.dp_shares is not None:  # heterogeneous devices: this dp rank's share (parallel/data/uneven.py)
            shares, me = cfg.parallel.dp_shares, mesh.coord("dp")
            chunks, weight = shares[me], loss_weight(shares, me)
        runner = LocalRunner(plan.model, plan.loss(), chunks, mesh.device, cfg.train.precision,
                             full_logits=plan.full_logits, vocab_size=cfg.model.vocab_size,
                             max_seq_len=cfg.model.max_seq_len, extra_metrics=plan.extra_metrics,
                             optimizer=plan.optimizer, loss_weight=weight)
    if plan.cp is not None:  # the trainer's samples continue whole prompts: every cp rank runs them whole
        runner.generate = whole_sequences(plan.cp, runner.generate)
    return runner
