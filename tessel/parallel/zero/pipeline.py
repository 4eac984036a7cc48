"""ZeRO under a pipeline: stage 3 gathered once per step, and how any stage meets tied embeddings.

ZeRO-3 with pipeline parallelism. Each pipeline rank shards its own chunks'
parameters over the ZeRO axes (dp, ep) as tessel.parallel.zero.zero_parallel does, but
gathers them once per step rather than around each layer:

    step start:  all-gather every chunk's parameters (one flat group per process group)
    micro-batches: forwards and backwards of the schedule on whole parameters;
                 gradients accumulate in the full-size buffer (no reduction)
    final backward of the rank: the buffer is reduce-scattered to the owners
    after the flush: parameters resharded (freed); the optimizer steps the shard

Regathering per layer and per micro-batch, as plain ZeRO-3 does, would
multiply the gather traffic by 2m (a forward and a backward gather for each of
m micro-batches), and the pipeline interleaves micro-batches so that a layer's
weights are needed again soon after they were freed. torchtitan composes FSDP
with pipelining the same way (reshard_after_forward=False).

Memory trade-off, for Psi_s parameters on this pipeline rank, N data shards,
fp32 weights and AdamW:

    at rest (between steps):  4Psi_s/N params + 4Psi_s/N grads + 8Psi_s/N optimizer
    during a step:            + 4Psi_s whole params + 4Psi_s accumulated gradients

so the peak of a step is that of ZeRO-2 under the same pipeline (which also
keeps whole parameters and accumulates whole gradients across micro-batches)
plus the 4Psi_s/N parameter shard, while between steps it holds 4Psi_s(N-1)/N
bytes less than ZeRO-2. What stage 3 buys under a pipeline is that memory
between steps (evaluation, checkpoints, other work on the device); what it
costs is one all-gather of the stage per step. Keeping the step's peak near
4Psi_s/N instead would take a gather before every micro-batch's forward and
backward and a reduce-scatter after every backward: about 3m times the traffic.

Tied embeddings (any ZeRO stage): the embedding's gradient lives on the first
stage and the head's on the last, and each stage must step on their sum. Under
stages 2 and 3 the owners keep only a shard, cut differently on the two stages,
so the sum must come before the reduce-scatter. A reduction inside the last
stage's backward cannot wait for the first stage (that stage still needs the
last stage's gradients), so ranks holding a tied copy reduce after the flush
instead: backward only accumulates, the pipeline sums the tied gradient between
the two stages, then `ZeroDataParallel.reduce_gradients` sends every gradient
to its owner (the runner, tessel.parallel.pipeline.runner). Stage 1 keeps whole
(dp-averaged) gradients, which the pipeline sums after the reduction as without
ZeRO. The last stage's copy is marked a replica, and so are the optimizer
segments cut from it, so the global gradient norm counts the tied weight once.
"""

from __future__ import annotations

from typing import Sequence

import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.zero.engine import ZeroDataParallel


def pipeline_zero3(chunks: nn.Module, mesh: Mesh, axes: Sequence[str] = ("dp", "ep"),
                   bucket_mb: float = 25.0) -> ZeroDataParallel:
    """ZeRO-3 over one pipeline rank's chunks: whole parameters for a step, shards at rest.

    All parameters form the root unit (no per-layer units, so no per-layer
    hooks): the runner wraps each step (or evaluation) in `step_gathered()`, which
    makes them whole and holds them until the step's end, past the
    end-of-backward resharding of every micro-batch."""
    return ZeroDataParallel(chunks, mesh, 3, axes, bucket_mb, units=[], chunks=True)
