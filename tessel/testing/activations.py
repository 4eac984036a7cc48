"""Activation memory of one training step, measured on this machine and as the planner predicts it.

`step_peak` builds what `tessel train` builds on each rank (mesh, model, tessel.parallelize, the rank's
shard of step 0's batch: under context parallelism its chunks of the sequences), runs one forward and
backward so that gradients and the data-parallel buffers exist, then measures the peak bytes a second one
allocates above that (tessel.observe.memory.allocated_peak: the profiler's allocation record on CPU, the
allocator's statistics on CUDA). `planned_peak` is the cost model's activations term for the same layout
(tessel.planner.cost: what a step keeps for backward, and the larger of the head's and a block's
backward work). tests/parallel/context/test_memory.py holds them to 10% of each other under cp;
benchmarks/cp_memory.py prints the table of the README.
"""

from __future__ import annotations

import torch

from tessel.apply import parallelize
from tessel.config import Config
from tessel.mesh import make_mesh
from tessel.models.build import build_model
from tessel.observe.memory import allocated_peak
from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import config_layout
from tessel.planner.model_spec import from_config
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.mesh_cohort import MeshCohort


def step_peak(cfg: Config) -> int:
    """Bytes one step's forward and backward allocate at their peak on this rank, above what it held before;
    collective over the current process group (or alone)."""
    p, t = cfg.parallel, cfg.train
    mesh = make_mesh(p.axis_sizes, order=p.rank_order)
    torch.manual_seed(t.seed)
    runner = parallelize(build_model(cfg.model), mesh, cfg)
    cohort = MeshCohort(mesh, t.grad_clip)
    shard, _ = cohort.shards()
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=t.seed)
    sampler = BatchSampler(tokens.train, t.seq_len, t.global_batch, t.seed, *shard,
                           columns=cohort.sequence_columns(t.seq_len))
    x, y = sampler.batch_at(0)
    runner.forward_backward(x, y)  # gradients (and their buffers) exist from here on
    return allocated_peak(lambda: runner.forward_backward(x, y), mesh.device)


def planned_peak(cfg: Config) -> float:
    """The cost model's activation bytes per rank for cfg's layout (its worst pipeline stage); the A100 preset,
    as tessel.testing.dryrun.planned uses: the term depends on the model and layout, not on the device."""
    p, t = cfg.parallel, cfg.train
    spec = from_config(cfg.model, t.seq_len, t.global_batch)
    model = CostModel(spec, get_cluster("a100", p.world_size), t.precision, bucket_mb=p.bucket_mb,
                      fused_loss=t.fused_loss)  # no fp32 logits to hold (tessel.parallel.fused_loss)
    return model.estimate(config_layout(cfg)).memory["activations"]
