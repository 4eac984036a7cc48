"""Data parallelism's apply step: gradients averaged over the token axes, for the model or a pipeline's chunks.

Beside ZeRO's step (tessel.parallel.zero.apply), the last of tessel.apply's order;
under ZeRO that step reduces the gradients and this one does nothing. The reducer
is parallel.dp_algorithm's (tessel.parallel.data.reducer). Without a pipeline
the model is wrapped; with one, each chunk gets its own DataParallel, which the
pipeline's GradientSync arms for that chunk's last backward, so the reduction of
a chunk overlaps the backwards still to come on the rank (PTD-P, Narayanan et
al. 2021, sec. 4.2).
"""

from __future__ import annotations

from tessel.axes import TOKEN_AXES
from tessel.config import ParallelConfig, RuntimeConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.parallel.data.data_parallel import DataParallel, data_parallel
from tessel.parallel.data.reducer import dp_reducer
from tessel.parallel.data.unused import mark_always_used
from tessel.parallel.plan import Plan


def apply_data_parallel(plan: Plan, mesh: Mesh, parallel: ParallelConfig, runtime: RuntimeConfig,
                        family: ModelFamily) -> Plan:
    """dp, ep or cp > 1 without ZeRO: the model wrapped, or under pp plan.chunk_dp (one wrapper per chunk)."""
    if parallel.zero_stage > 0 or mesh.size(*TOKEN_AXES) == 1:
        return plan
    if family.uses_every_parameter:  # no step asks which went unused: no host read (parallel/data/unused.py)
        mark_always_used(plan.model.parameters())
    reducer = dp_reducer(parallel.dp_algorithm, mesh.world_size, runtime)
    if mesh.size("pp") > 1:
        plan.chunk_dp = [DataParallel(chunk, mesh, TOKEN_AXES, parallel.bucket_mb, reducer=reducer)
                         for chunk in plan.model]
    else:
        plan.model = data_parallel(plan.model, mesh, axes=TOKEN_AXES, bucket_mb=parallel.bucket_mb, reducer=reducer)
    return plan
