"""ZeroDataParallel: a module wrapper that runs one ZeRO stage, composed of two pieces.

Rajbhandari et al. 2020, section 5: every stage shards the optimizer state
(tessel.parallel.zero.optim steps the owned shard only); the stages differ in
what they do with gradients after backward (tessel.parallel.zero.gradients)
and where parameters live between uses (tessel.parallel.zero.parameters):

    stage  paper      gradients                 parameters
    1      P_os       AllReduceGradients        WholeParameters
    2      P_os+g     ReduceScatterGradients    WholeParameters
    3      P_os+g+p   ReduceScatterGradients    GatheredParameters

The wrapper itself lays the parameters out by process group, broadcasts the
first rank's weights (frozen ones and buffers too; with broadcast_buffers, the
first rank's buffers again before every training forward, as DDP), casts inputs
and frozen parameters to param_dtype, and passes autograd's per-parameter hooks
to the pieces. tessel.parallel.zero.zero_parallel explains the stages, their
memory and usage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ContextManager, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from tessel.mesh import Mesh
from tessel.parallel.data.broadcast import BufferBroadcast, broadcast_by_axes, broadcast_tensors
from tessel.parallel.data.data_parallel import GradientSyncWrapper
from tessel.parallel.zero.flat import Comm, FlatSpec, Precision, trainable
from tessel.parallel.zero.gradients import AllReduceGradients, GradientReduction, ReduceScatterGradients
from tessel.parallel.zero.parameters import GatheredParameters, ParameterPlacement, WholeParameters, map_tensors
from tessel.sharding import shard_axes


@dataclass(frozen=True)
class Stage:
    """A ZeRO stage as the two pieces that differ between stages."""
    gradients: type[GradientReduction]   # what backward does with gradients
    parameters: type[ParameterPlacement]  # where parameters live between uses


STAGES = {1: Stage(AllReduceGradients, WholeParameters),       # P_os (section 5.1)
          2: Stage(ReduceScatterGradients, WholeParameters),   # P_os+g (section 5.2)
          3: Stage(ReduceScatterGradients, GatheredParameters)}  # P_os+g+p (section 5.3)


class ZeroDataParallel(GradientSyncWrapper):
    """Wraps a module; ZeRO stage 1, 2 or 3 over `axes` of the mesh.

    The interface the optimizer (ZeroAdamW), its checkpoint hook and the pipeline
    runner use: `module`, `stage`, `groups` (the flat groups, gradient order),
    `sync_gradients`, model_name, publish, zero_grad_buffers, reduce_gradients, gathered and
    step_gathered. chunks: `module` is a pipeline rank's list of chunks (tessel.parallel.pipeline), whose
    parameters the checkpoint names as the full model does (model_name)."""

    def __init__(self, module: nn.Module, mesh: Mesh, stage: int, axes: Sequence[str] = ("dp",),
                 bucket_mb: float = 25.0, units: Sequence[nn.Module] | None = None, broadcast: bool = True,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 broadcast_buffers: bool = True, chunks: bool = False):
        super().__init__()
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 (0 is tessel.parallel.data.data_parallel), got {stage}")
        self.module, self.stage, self.axes = module, stage, tuple(axes)
        self.chunks = chunks  # module: a pipeline rank's chunks, each under the full model's names
        self.defer_reduction = stage == 1  # stages 2, 3: gradients stay sharded across micro-steps
        # mixed precision (tessel.parallel.zero.zero_parallel): the module computes with
        # parameters in param_dtype, gradients are reduced in reduce_dtype (default: param_dtype)
        param_dtype = param_dtype or torch.float32
        self.precision = Precision(param_dtype, reduce_dtype or param_dtype)
        self.sync_gradients = True
        params = trainable(module)
        _check_fp32(params)
        by_comm = _by_comm(mesh, self.axes, params)
        if broadcast:
            _broadcast(mesh, self.axes, module, by_comm)
        if broadcast_buffers and mesh.size(*self.axes) > 1:
            self.buffer_sync = BufferBroadcast(module, mesh, self.axes)
        if param_dtype != torch.float32:
            _cast_frozen(module, param_dtype)
        spec = FlatSpec(module, params, by_comm, int(bucket_mb * 2**20), units, self.precision)
        self.placement = STAGES[stage].parameters(spec)
        self.groups = self.placement.groups
        # a gradient of another dtype than its parameter cannot be its .grad: such
        # gradients are added into the flat buffer by the reduction instead
        self.reduction = STAGES[stage].gradients(self.groups, mesh.size(*self.axes),
                                                 add_into_buffer=self.precision.grad_dtype != param_dtype)
        self._callback_queued = False
        self._hooks = [p.register_post_accumulate_grad_hook(self._on_grad_ready) for p in params]
        self.placement.install_hooks(on_backward=self._queue_finish)
        if param_dtype != torch.float32:
            module.register_forward_pre_hook(self._cast_inputs, with_kwargs=True)

    def _cast_inputs(self, module, args, kwargs):
        """Floating-point inputs, positional or by keyword, to param_dtype, as the parameters they
        meet (FSDP2's cast_forward_inputs does the same)."""
        dtype = self.precision.param_dtype
        return map_tensors((args, kwargs), lambda t: t.to(dtype) if t.is_floating_point() else t)

    # ---- parameters --------------------------------------------------------------------
    def model_name(self, name: str) -> str:
        """A parameter's name in the full model (checkpoints): a pipeline's chunks keep those names under
        their index in the rank's list ('1.layers.3.mlp.w1.weight' -> 'layers.3.mlp.w1.weight')."""
        return name.split(".", 1)[1] if self.chunks else name

    def gathered(self) -> ContextManager[None]:
        """Every parameter whole for the duration (stage 3; a no-op otherwise): state dicts, checks."""
        return self.placement.gathered()

    def step_gathered(self) -> ContextManager[None]:
        """Every parameter whole for a step's micro-batches (stage 3 under a pipeline; a no-op otherwise)."""
        return self.placement.step_gathered()

    def root_gathered(self) -> ContextManager[None]:
        """The root unit (what no unit holds: embedding, head) whole for the duration (stage 3; a no-op
        otherwise): the fused loss reads the head after a forward that freed it (tessel.parallel.fused_loss)."""
        return self.placement.root_gathered()

    def publish(self) -> None:
        """After the optimizer updated the owned shards: make the parameters whole (stages 1, 2)."""
        self.placement.publish()

    # ---- gradients -----------------------------------------------------------------------
    def _on_grad_ready(self, p: nn.Parameter) -> None:
        self._queue_finish()
        g = self.reduction.arrived(p, self.sync_gradients)
        if g is None:
            return
        self.placement.release(g)
        if self.sync_gradients:
            self.reduction.launch_ready()

    def _queue_finish(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finish)

    def _finish(self) -> None:
        if self.sync_gradients:
            self.reduction.reduce_all()
        self.reduction.end_backward()
        self.placement.end_backward()
        self._callback_queued = False

    def zero_grad_buffers(self) -> None:
        self.reduction.zero_all()

    def reduce_gradients(self) -> None:
        """Reduce now, outside backward, what backward accumulated with sync_gradients = False.

        A pipeline whose first and last stages share the tied embedding sums the two
        full gradients between stages first (that needs every stage's backward done),
        then calls this, so the owners receive the tied sum (tessel.parallel.pipeline)."""
        self.sync_gradients = True
        self._finish()


def _check_fp32(params: list[nn.Parameter]) -> None:
    bad = [p.dtype for p in params if p.dtype != torch.float32]
    if bad:
        raise ValueError(f"ZeRO keeps fp32 master weights: parameters must be fp32 (found {bad[0]}); "
                         "use autocast for bf16 compute")


def _by_comm(mesh: Mesh, axes: tuple[str, ...], params: list[nn.Parameter]) -> dict[Comm, list[nn.Parameter]]:
    """Parameters by the process group that shards them: a parameter already sharded over
    an axis (experts over ep) is sharded and reduced over the remaining ZeRO axes only."""
    by_comm: dict[Comm, list[nn.Parameter]] = {}
    for p in params:
        key = tuple(a for a in axes if a not in shard_axes(p))
        by_comm.setdefault(_comm(mesh, key), []).append(p)
    return by_comm


def _comm(mesh: Mesh, axes: tuple[str, ...]) -> Comm:
    group = mesh.group(*axes)
    # the shard order of a collective is the rank order inside its process group
    return Comm(axes, group, mesh.size(*axes), dist.get_rank(group) if group is not None else 0)


def _broadcast(mesh: Mesh, axes: tuple[str, ...], module: nn.Module, by_comm: dict[Comm, list[nn.Parameter]]) -> None:
    """Every rank of a group starts from the same weights: those of its first rank. Frozen
    parameters and buffers too, each over the axes that replicate it (as DDP and FSDP do)."""
    for comm, ps in by_comm.items():
        if comm.group is not None:
            broadcast_tensors(ps, src=mesh.group_ranks(comm.axes)[0], group=comm.group)
    frozen = [p for p in dict.fromkeys(module.parameters()) if not p.requires_grad]
    broadcast_by_axes(mesh, axes, [*frozen, *module.buffers()])


def _cast_frozen(module: nn.Module, dtype: torch.dtype) -> None:
    """Frozen floating-point parameters compute in param_dtype like the rest (FSDP2 casts every
    parameter it gathers); they never step, so no fp32 copy is kept. Buffers keep their dtype."""
    for p in dict.fromkeys(module.parameters()):
        if not p.requires_grad and p.is_floating_point():
            p.data = p.data.to(dtype)
