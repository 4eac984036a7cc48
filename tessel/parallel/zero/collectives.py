"""ZeRO's collectives, named after what they do (Rajbhandari et al. 2020, sections 5 and 7).

Each takes flat buffers (tessel.parallel.zero.flat) and the process group that
shards them; None stands for a group of one, where the collective is a copy.
gloo and NCCL both implement the single-tensor forms used here. Each returns
the collective's work object (None when there was nothing to wait for).

Traffic per step for Psi parameters, in elements sent per rank (section 7):

    plain data parallelism, stage 1   all-reduce 2Psi
    stage 2                            reduce-scatter Psi + all-gather Psi = 2Psi
    stage 3                            all-gather Psi before forward, Psi before backward,
                                       reduce-scatter Psi = 3Psi
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_reduce_gradients(buffer: torch.Tensor, group) -> dist.Work | None:
    """Stage 1 (P_os, section 5.1): every rank gets the whole summed gradient, as in plain
    data parallelism; the optimizer then reads only its own shard of it. In place."""
    if group is None:
        return None
    return dist.all_reduce(buffer, group=group, async_op=True)


def reduce_scatter_gradients(out: torch.Tensor, full: torch.Tensor, group) -> dist.Work | None:
    """Stages 2, 3 (P_g, section 5.2): (numel,) gradient -> (numel/N,) sum of this rank's shard.

    Each rank receives only the gradient of the shard it updates, so the whole
    summed gradient never exists anywhere; the input can be freed once sent."""
    if group is None:
        out.copy_(full)
        return None
    return dist.reduce_scatter_single(out, full, group=group, async_op=True)


def all_gather_shards(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = True) -> dist.Work | None:
    """(numel/N,) this rank's shard -> (numel,) the whole flat tensor, on every rank of the group.

    Stages 1, 2: the updated parameters after the optimizer step (section 5.1: each
    rank updates its partition, then all-gathers everyone's at the end of the step).
    Stage 3: a unit's parameters just before its forward and its backward (section 5.3).
    Checkpoints: shards of parameters and optimizer state, whole again."""
    if group is None:
        if out.data_ptr() != shard.data_ptr():
            out.copy_(shard)
        return None
    return dist.all_gather_single(out, shard, group=group, async_op=async_op)
