"""The ZeRO optimizer: torch's AdamW on the shard this rank owns (P_os, Rajbhandari et al. 2020, section 5.1).

Its parameters are "segments": the pieces of a flat group's owned shard
(tessel.parallel.zero.flat), one per parameter. The caller gives parameter
groups over the module's parameters, as to any torch optimizer; each group's
options carry over to the segments cut from its parameters. A segment whose
gradient is "no gradient" (-0.0 everywhere: no rank used its parameter since
the last zero_grad, tessel.parallel.data.unused) has grad None for the step, so
AdamW skips it as it skips an unused parameter without ZeRO. After stepping, the
optimizer asks the engine to make the parameters whole again (publish);
checkpoints save and load its shard as logical whole tensors
(tessel.parallel.zero.checkpoint). The segments of a parameter group are
stepped together, in one fused (CUDA) or foreach kernel per group
(tessel.parallel.adamw), not one update per segment.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
import torch.nn as nn

from tessel.parallel.adamw import kernel_options
from tessel.parallel.data.unused import mark_always_used, may_go_unused, no_gradient
from tessel.parallel.zero import checkpoint
from tessel.parallel.zero.engine import ZeroDataParallel
from tessel.parallel.zero.flat import FlatGroup
from tessel.sharding import is_replica, mark_replica, mark_sharded, shard_axes


class ZeroAdamW(torch.optim.AdamW):
    """AdamW on the owned shard only; `step` then makes the parameters whole again.

    `params`: the module's parameters, or parameter groups (dicts with "params"
    and options such as "weight_decay"), as torch.optim.AdamW takes them; a
    parameter in no group is not stepped. A real torch AdamW (so LambdaLR and
    other schedulers work) whose parameters are the owned segments. Gradients are
    views of flat buffers, so zero_grad always zeroes in place, whatever
    set_to_none says. Its state_dict holds this rank's shard only."""

    def __init__(self, engine: ZeroDataParallel, params: Iterable[nn.Parameter] | Iterable[dict],
                 lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.01):
        groups = _param_groups(params)
        segs = segments(engine.groups, _group_index(groups, engine.groups))
        groups = [{**group, "params": segs.get(k, [])} for k, group in enumerate(groups)]
        super().__init__(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel_options(groups))
        self.engine = engine

    @torch.no_grad()
    def step(self, closure=None):
        segs = [seg for seg in self.grad_params() if seg.grad is not None and may_go_unused(seg)]
        skipped = [(seg, seg.grad) for seg, unused in zip(segs, no_gradient([s.grad for s in segs])) if unused]
        for seg, _ in skipped:
            seg.grad = None  # AdamW leaves a parameter without a gradient alone
        try:
            loss = super().step(closure)
        finally:
            for seg, grad in skipped:
                seg.grad = grad  # the view of the gradient shard, for the next step
        self.engine.publish()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad_buffers()

    def grad_params(self) -> list[nn.Parameter]:
        """The segments: what the global gradient norm is taken over."""
        return [p for group in self.param_groups for p in group["params"]]

    # ---- checkpoints (tessel.train.checkpoint.logical's hook): logical whole tensors ----------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return checkpoint.checkpoint_tensors(self.engine, self)

    def checkpoint_model_names(self) -> set[str]:
        return checkpoint.model_names(self.engine)

    def load_checkpoint_tensors(self, reader, metadata, localize=None) -> None:
        checkpoint.load_checkpoint_tensors(self.engine, self, reader, metadata, localize)


def _param_groups(params: Iterable[nn.Parameter] | Iterable[dict]) -> list[dict]:
    """torch.optim's first argument, as a list of groups (dicts with a list under "params")."""
    params = list(params)
    if params and not isinstance(params[0], dict):
        params = [{"params": params}]
    return [{**group, "params": list(group["params"])} for group in params]


def _group_index(groups: list[dict], flat_groups: list[FlatGroup]) -> Callable[[nn.Parameter], int | None]:
    """parameter -> the index of its group (None: in no group); checks what torch would."""
    index: dict[int, int] = {}
    for k, group in enumerate(groups):
        for p in group["params"]:
            if index.setdefault(id(p), k) != k:
                raise ValueError("some parameters appear in more than one parameter group")
    sharded = {id(p) for g in flat_groups for p in g.params}
    if any(p.requires_grad and id(p) not in sharded for group in groups for p in group["params"]):
        raise ValueError("a parameter group holds a parameter that this ZeRO engine does not shard")
    return lambda p: index.get(id(p))


def segments(groups: list[FlatGroup], group_of: Callable[[nn.Parameter], int | None]
             ) -> dict[int, list[nn.Parameter]]:
    """The optimizer's parameters: owned pieces of each flat group, by parameter group.

    A segment is one parameter's piece of the owned shard: one per parameter, not
    one per run of them, so that a parameter no rank used can be skipped alone.
    Each segment aliases the owned parameter shard, and its gradient the gradient
    shard, so the optimizer updates the flat buffers in place. A segment is marked
    sharded over its group's axes and over those its parameter was already sharded
    on (tp, ep), so the global gradient norm adds the pieces up; a piece of a
    replica (tessel.sharding.mark_replica) is a replica too."""
    out: dict[int, list[nn.Parameter]] = {}
    for g in groups:
        for a, b, p in owned_pieces(g):
            k = group_of(p)
            if k is None:
                continue  # parameters no group steps
            seg = nn.Parameter(g.shard[a - g.lo: b - g.lo], requires_grad=False)
            seg.grad = g.grad_shard[a - g.lo: b - g.lo]
            mark_sharded(seg, *g.comm.axes, *shard_axes(p))
            if is_replica(p):  # a copy another pipeline stage counts (the last stage's tied head)
                mark_replica(seg)
            if not may_go_unused(p):
                mark_always_used([seg])
            out.setdefault(k, []).append(seg)
    return out


def owned_pieces(g: FlatGroup) -> list[tuple[int, int, nn.Parameter]]:
    """(start, end, parameter) in flat coordinates: each parameter clipped to the owned shard."""
    pieces = []
    for p, off in zip(g.params, g.offsets):
        a, b = max(g.lo, off), min(g.hi, off + p.numel())
        if a < b:
            pieces.append((a, b, p))
    return pieces
