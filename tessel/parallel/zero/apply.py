"""ZeRO's apply step (parallel.zero_stage > 0): one door for the model and for a pipeline rank's chunks.

The last step of tessel.apply's order, with the data-parallel step beside it
(tessel.parallel.data.apply, which does nothing under ZeRO): the model (or
chunks) it wraps is the one every earlier step left, tensor-parallel, split,
recomputed and compiled, so ZeRO's hooks wrap the compiled blocks. Without a
pipeline the model is wrapped whole (tessel.parallel.zero.zero_parallel). With
one, the engine spans all of this rank's chunks and the pipeline's GradientSync
arms it for the rank's last backward: ZeRO 1/2 as without a pipeline, ZeRO-3
gathered once per step (tessel.parallel.zero.pipeline). Either way the optimizer
steps the shard this rank owns, its groups those of tessel.parallel.weight_decay.
"""

from __future__ import annotations

from tessel.axes import TOKEN_AXES
from tessel.config import ParallelConfig, TrainConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.parallel.data.unused import mark_always_used
from tessel.parallel.plan import Plan
from tessel.parallel.weight_decay import param_groups
from tessel.parallel.zero.optim import ZeroAdamW
from tessel.parallel.zero.pipeline import pipeline_zero3
from tessel.parallel.zero.zero_parallel import zero_dtypes, zero_parallel


def apply_zero(plan: Plan, mesh: Mesh, parallel: ParallelConfig, train: TrainConfig, family: ModelFamily) -> Plan:
    """ZeRO over the token axes (dp, ep, cp): plan.optimizer is its AdamW; the model is wrapped, or under pp
    plan.zero is the engine over the chunks."""
    if parallel.zero_stage == 0:
        return plan
    if family.uses_every_parameter:  # no step asks which went unused: no host read (parallel/data/unused.py)
        mark_always_used(plan.model.parameters())
    groups = param_groups(plan.model.parameters(), train.weight_decay)
    hyper = dict(lr=train.lr, betas=(train.beta1, train.beta2))
    if mesh.size("pp") > 1:
        return _zero_over_chunks(plan, mesh, parallel, groups, hyper)
    plan.model, plan.optimizer = zero_parallel(plan.model, mesh, parallel.zero_stage, groups, axes=TOKEN_AXES,
                                               bucket_mb=parallel.bucket_mb, **hyper, **zero_dtypes(parallel))
    if plan.fused is not None:  # ZeRO-3 frees the head after a forward without gradients: gather it to read
        plan.fused.whole = plan.model.root_gathered
    return plan


def _zero_over_chunks(plan: Plan, mesh: Mesh, parallel: ParallelConfig, groups: list[dict], hyper: dict) -> Plan:
    """A pipeline rank's chunks (in fp32: tessel.config refuses ZeRO's other dtypes under pp)."""
    if parallel.zero_stage == 3:  # whole parameters for a step, shards at rest
        plan.zero = pipeline_zero3(plan.model, mesh, axes=TOKEN_AXES, bucket_mb=parallel.bucket_mb)
        plan.optimizer = ZeroAdamW(plan.zero, groups, **hyper)
    else:  # the chunks' checkpoint names drop the chunk's index (ZeroDataParallel.model_name)
        plan.zero, plan.optimizer = zero_parallel(plan.model, mesh, parallel.zero_stage, groups, axes=TOKEN_AXES,
                                                  bucket_mb=parallel.bucket_mb, chunks=True, **hyper)
    return plan
