"""A dry run of real memory at scale: the parallelized model of any layout, on the meta device.

One process impersonates one rank of a large world at a time: torch's fake
process group (torch.testing._internal.distributed.fake_pg: every collective
returns at once and moves nothing) stands in for the world, and the reference
model is built on the meta device, so tensors have shapes and dtypes but no
storage. The rank goes through the real path (tessel.parallelize: TP/SP, the
pipeline split, ZeRO's flat groups), runs one forward and backward of each of
its chunks on one sequence, so that the gradient buffers the runtime allocates
exist, and steps its optimizer, so that AdamW's state exists. What the rank then
holds (tessel.parallel.zero.memory.state_bytes) is what the planner's
state_memory (tessel.planner.pricing.zero) must predict.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.config import Config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.parallel.data.data_parallel import DataParallel
from tessel.parallel.pipeline.runner import PipelineRunner
from tessel.parallel.runner import LocalRunner
from tessel.parallel.zero.memory import state_bytes
from tessel.parallel.zero.optim import ZeroAdamW
from tessel.apply import parallelize
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import from_config
from tessel.train.optim import build_optimizer


def dry_run(cfg: Config, ranks: list[int]) -> dict[int, dict[str, int]]:
    """{rank: bytes of params, grads and optimizer state} for each of `ranks` under cfg's layout.

    Dense models: an MoE block routes by the values of its tokens, which meta tensors do not have."""
    if cfg.model.n_experts:
        raise ValueError("the dry run builds dense models only: MoE routing reads token values, "
                         "which meta tensors do not have")
    return {rank: _one_rank(cfg, rank) for rank in ranks}


def planned(cfg: Config, ranks: list[int]) -> dict[int, dict[str, float]]:
    """The planner's bytes for the same ranks, in dry_run's terms (by each rank's pipeline stage; the
    cluster is the A100 preset, which these bytes do not depend on: a world of 8 or a multiple of it).

    The planner counts as the ZeRO paper does (tessel.planner.memory.zero_state_bytes): fp32 master
    weights inside the optimizer state (K = 12 with bf16 storage) and the fp32 gradient shard apart;
    the runtime holds the masters among its parameters (the flat shards) and the fp32 gradient shard
    among its gradients."""
    p, t = cfg.parallel, cfg.train
    mesh = make_mesh(p.axis_sizes, order=p.rank_order, build=False)
    spec = from_config(cfg.model, t.seq_len, t.global_batch)
    model = CostModel(spec, get_cluster("a100", mesh.world_size), t.precision, bucket_mb=p.bucket_mb,
                      reduce_dtype=p.zero_reduce_dtype)
    stages = model.estimate(config_layout(cfg)).stage_memory
    out = {}
    for rank in ranks:
        stage = mesh.coords(rank)["pp"]
        if stage not in stages:  # the cost model prices the first and last stages (every one when v > 1)
            raise ValueError(f"rank {rank} is on pipeline stage {stage}: pick ranks of stages {sorted(stages)}")
        mem = stages[stage]
        masters = mem["optimizer"] / 3 if p.zero_param_dtype != "fp32" else 0.0  # 4 of K = 12 bytes
        out[rank] = {"params": mem["params"] + masters, "grads": mem["grads"] + mem["fp32_grads"],
                     "optimizer": mem["optimizer"] - masters}
    return out


def _one_rank(cfg: Config, rank: int) -> dict[str, int]:
    from torch.testing._internal.distributed.fake_pg import FakeStore  # deferred: torch's test utilities

    p = cfg.parallel
    world = make_mesh(p.axis_sizes, order=p.rank_order, build=False).world_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = make_mesh(p.axis_sizes, order=p.rank_order, rank=rank)
        with torch.device("meta"):
            model = build_model(cfg.model)
        runner = parallelize(model, mesh, cfg)
        engine, optimizer, grads_in_step = _backward_once(runner, cfg)
        # AdamW's own step (ZeRO's first asks which gradients are "no gradient", a read meta cannot do)
        torch.optim.AdamW.step(optimizer)
        held = state_bytes(engine, optimizer)
        return {**held, "grads": max(held["grads"], grads_in_step)}
    finally:
        dist.destroy_process_group()


def _backward_once(runner: LocalRunner | PipelineRunner,
                   cfg: Config) -> tuple[nn.Module, torch.optim.Optimizer, int]:
    """One sequence forward and backward through each of this rank's chunks, then every reduction;
    returns (the module whose storages count, its optimizer, the gradient bytes before the
    reductions: under a pipeline they accumulate whole over the step, ZeRO-2/3 too)."""
    tokens = torch.zeros(1, cfg.train.seq_len, dtype=torch.long, device="meta")
    if not isinstance(runner, PipelineRunner):
        # plain DP's reduction asks which gradients are "no gradient" (a read meta cannot do); its
        # buckets hold the gradients either way. ZeRO's reductions run: stage 2 frees what it reduced
        skip = runner.model.no_sync() if isinstance(runner.model, DataParallel) else contextlib.nullcontext()
        with skip:
            out = runner.model(tokens)
            torch.autograd.backward(out, torch.ones_like(out))
        optimizer = runner.optimizer or build_optimizer(runner.parameters(), cfg.train)
        return runner.model, optimizer, 0
    chunks, sync = runner.chunks, runner.sync
    optimizer = runner.optimizer or build_optimizer(runner.parameters(), cfg.train)
    zero = optimizer.engine if isinstance(optimizer, ZeroAdamW) else None
    engine = zero or nn.ModuleList(chunks)
    hidden = torch.zeros(1, cfg.train.seq_len // runner.spec.seq_shards, cfg.model.d_model, device="meta")
    with sync.whole_parameters():
        for c, chunk in enumerate(chunks):
            out = chunk(tokens if runner.placement.is_first(c) else hidden.requires_grad_(True))
            # reductions after the count (plain DP's never: it reads gradients' values, see above)
            sync.before_backward(c, chunk_done=False, rank_done=False)
            torch.autograd.backward(out, torch.ones_like(out))
        in_step = state_bytes(engine, optimizer)["grads"]
        if zero is not None:
            zero.reduce_gradients()
        sync.after_flush()
    return engine, optimizer, in_step
