"""ZeRO: optimizer-state, gradient and parameter sharding over the data-parallel axes.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models". Parameters live in flat buffers ("flat groups"), each
zero-padded to a multiple of N, the size of the data-parallel group, and cut
into N equal contiguous shards; rank r owns shard r of every group.

- stage 1: every rank keeps full parameters and full gradients, all-reduced in
  buckets during backward as in tessel.parallel.data.data_parallel; the optimizer state
  covers the owned shard only. Each rank updates its shard of the flat fp32
  buffer, then every buffer is all-gathered.
- stage 2: as stage 1, but each gradient bucket is reduce-scattered as soon as
  backward has filled it (post-accumulate-grad hooks) and then freed, so a rank
  keeps only the gradient shard it owns.
- stage 3: parameters are sharded too. Each unit (by default every child of
  every nn.ModuleList or nn.Sequential, outermost first: decoder layers,
  ResNet blocks; tessel.parallel.zero.flat.find_units; plus the rest of the
  model as the root unit) is all-gathered just before its forward and again
  just before its backward, and freed after each; the next unit's gather is
  issued before the current unit computes (prefetch), so communication
  overlaps compute. The root unit stays gathered from the start of forward to
  the end of backward. Between uses a parameter's values cannot be read (a
  Python error says so): read them inside `gathered()`, or take state_dict(),
  which gathers whole copies (so `save_pretrained` works).

Precision. By default parameters, gradients and optimizer state are fp32, so
the parameters are the master weights; bf16 compute comes from autocast
(train.precision = "bf16"), which casts each weight to bf16 at its matmul.
Memory per rank for Psi parameters, N ranks, AdamW (exp_avg and exp_avg_sq):

    stage  params   grads    optimizer
    0      4Psi     4Psi     8Psi
    1      4Psi     4Psi     8Psi/N
    2      4Psi     4Psi/N   8Psi/N
    3      4Psi/N   4Psi/N   8Psi/N       (plus the units gathered at the moment)

Mixed-precision storage (param_dtype, reduce_dtype; FSDP2's MixedPrecisionPolicy,
and the paper's fp16 parameters and gradients with fp32 master copies): the
module's parameters, and every all-gather of them, are in param_dtype (p bytes),
its floating inputs are cast to it, and gradients are accumulated and reduced in
reduce_dtype (r bytes). The owned shard of the fp32 master weights, its fp32
gradient and AdamW's state stay fp32, and the optimizer updates those; the
low-precision parameters are refreshed from them (stages 1, 2: cast and
all-gathered after each step; stage 3: at every gather). Per rank:

    stage  params             grads              optimizer
    1      pPsi + 4Psi/N      rPsi + 4Psi/N (*)  8Psi/N
    2      pPsi + 4Psi/N      4Psi/N             8Psi/N
    3      4Psi/N             4Psi/N             8Psi/N   (gathered units take p bytes per element)
    (*) rPsi alone when r = 4: the fp32 shard is then a view of the reduced buffer

Any module. Parameters unused in a step keep no gradient (AdamW skips them, as
under DDP with find_unused_parameters: tessel.parallel.data.unused). Frozen
parameters (requires_grad=False) and buffers are broadcast from the first rank
at wrap time and stay whole on every rank, in param_dtype; they are not sharded,
even at stage 3. Inputs reach the module as they are passed (by position or by
keyword; floating ones cast to param_dtype) and outputs leave it with their
type (a transformers ModelOutput stays one). broadcast_buffers (default, as
DDP's): the first rank's persistent buffers, such as BatchNorm's running
statistics, to every rank before each training forward.

How the stages are built: tessel.parallel.zero.engine (one object per stage
behaviour: tessel.parallel.zero.gradients, tessel.parallel.zero.parameters).
The optimizer (tessel.parallel.zero.optim) is torch's AdamW stepping
"segments": the pieces of the owned shard that belong to parameters of one
parameter group and one sharding class. They are marked sharded over the ZeRO
axes (tessel.parallel.norms), so the global gradient norm over the optimizer's
parameters is the norm of the whole model. Usage, on any nn.Module, with
parameter groups as any torch optimizer takes them (here the trainer's: weight
decay on matrices only, tessel.parallel.weight_decay.param_groups):

    groups = param_groups(model.parameters(), weight_decay=0.1)
    model, opt = zero_parallel(model, mesh, 3, groups, lr=3e-4)
    # model(...) trains as usual; under stage 3, read weights inside `with model.gathered():`
    with model.no_sync():                 # accumulation micro-steps: no traffic
        loss_fn(model(x0), y0).backward()
    loss_fn(model(x1), y1).backward()     # gradients reach their owners, averaged
    clip_grad_norm_(opt.grad_params(), 1.0, mesh)
    opt.step()                            # update own shard, all-gather (stages 1, 2)
    opt.zero_grad()
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.adamw import adamw
from tessel.parallel.data.data_parallel import data_parallel
from tessel.parallel.zero.engine import ZeroDataParallel
from tessel.parallel.zero.optim import ZeroAdamW


def zero_parallel(module: nn.Module, mesh: Mesh, stage: int, params: Iterable[nn.Parameter] | Iterable[dict], *,
                  lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01,
                  axes: Sequence[str] = ("dp",), bucket_mb: float = 25.0, units: Sequence[nn.Module] | None = None,
                  param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                  broadcast_buffers: bool = True, chunks: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """tessel's ZeRO for any nn.Module: returns (wrapped model, AdamW over what this rank owns).

    `params`: the module's parameters or parameter groups, as torch.optim.AdamW takes
    them (weight_decay applies to groups that set none). Stage 0 is plain data
    parallelism (tessel.parallel.data.data_parallel) with a full AdamW.
    `units` (stage 3) are the modules gathered as one; default: find_units(module) (children of
    ModuleList/Sequential containers); size_based_units(module, n) picks them by size instead.
    param_dtype / reduce_dtype (stages 1-3): the dtype the module computes with and the
    gradients are reduced in; the optimizer keeps fp32 masters (module docstring).
    broadcast_buffers: as DDP's, the first rank's persistent buffers to every rank before each
    forward that a synchronised backward follows. chunks: `module` is a pipeline rank's list of chunks
    (their checkpoint names drop the chunk's index: ZeroDataParallel.model_name)."""
    hyper = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if stage == 0:
        if param_dtype not in (None, torch.float32) or reduce_dtype not in (None, torch.float32):
            raise ValueError("param_dtype/reduce_dtype need ZeRO stage 1, 2 or 3 (fp32 masters)")
        return (data_parallel(module, mesh, axes, bucket_mb, broadcast_buffers=broadcast_buffers),
                adamw(params, **hyper))
    model = ZeroDataParallel(module, mesh, stage, axes, bucket_mb, units, param_dtype=param_dtype,
                             reduce_dtype=reduce_dtype, broadcast_buffers=broadcast_buffers, chunks=chunks)
    return model, ZeroAdamW(model, params, **hyper)


def zero_dtypes(parallel) -> dict[str, torch.dtype | None]:
    """zero_parallel's param_dtype/reduce_dtype from a ParallelConfig."""
    dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, None: None}
    return {"param_dtype": dtypes[parallel.zero_param_dtype], "reduce_dtype": dtypes[parallel.zero_reduce_dtype]}
