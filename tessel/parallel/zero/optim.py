"""The ZeRO optimizer: torch's AdamW on the shard this rank owns (Rajbhandari et al. 2020).

Split from tessel.parallel.zero.zero_parallel, whose ZeroDataParallel engine owns the flat
buffers: the optimizer steps the owned segments, then asks the engine to make
the parameters whole again (publish), and saves or loads its shard as
logical whole tensors (tessel.parallel.zero.checkpoint).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from tessel.parallel.zero import checkpoint as zero_ckpt
from tessel.parallel.zero.flat import segments

if TYPE_CHECKING:
    from tessel.parallel.zero.zero_parallel import ZeroDataParallel


def default_decay(p: nn.Parameter) -> bool:
    """Weight decay on matrices only; norms and biases get none (nanoGPT, GPT-3)."""
    return p.dim() >= 2


def decay_groups(params, decay: Callable[[nn.Parameter], bool], weight_decay: float) -> list[dict]:
    """AdamW parameter groups: those `decay` picks with weight_decay, the rest with none."""
    params = list(params)
    return [{"params": [p for p in params if decay(p)], "weight_decay": weight_decay},
            {"params": [p for p in params if not decay(p)], "weight_decay": 0.0}]


class ZeroAdamW(torch.optim.AdamW):
    """AdamW on the owned shard only; `step` then makes the parameters whole again.

    A real torch AdamW (so LambdaLR and other schedulers work) whose parameters
    are the owned segments (tessel.parallel.zero.flat.segments). Gradients are
    views of flat buffers, so zero_grad always zeroes in place, whatever
    set_to_none says. Its state_dict holds this rank's shard only."""

    def __init__(self, engine: ZeroDataParallel, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.01, decay: Callable[[nn.Parameter], bool] = default_decay):
        decay_segs, plain_segs = segments(engine.groups, decay)
        groups = [{"params": decay_segs, "weight_decay": weight_decay},
                  {"params": plain_segs, "weight_decay": 0.0}]
        super().__init__(groups, lr=lr, betas=betas, eps=eps)
        self.engine = engine

    @torch.no_grad()
    def step(self, closure=None):
        loss = super().step(closure)
        self.engine.publish()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad_buffers()

    def grad_params(self) -> list[nn.Parameter]:
        return optimizer_params(self)

    # ---- checkpoints (tessel.train.checkpoint.logical's hook): logical whole tensors, see zero_ckpt --------
    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        return zero_ckpt.checkpoint_tensors(self)

    def checkpoint_model_names(self) -> set[str]:
        return zero_ckpt.model_names(self)

    def load_checkpoint_tensors(self, reader, metadata, localize=None) -> None:
        zero_ckpt.load_checkpoint_tensors(self, reader, metadata, localize)


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes this rank holds now in parameters, gradients and optimizer state.

    Counts each storage once (views share one), at its allocated size: a
    stage-3 buffer that is freed counts 0."""
    def total(tensors) -> int:
        seen: dict[int, int] = {}
        for t in tensors:
            if t is not None:
                s = t.untyped_storage()
                seen[s.data_ptr() if s.nbytes() else id(s)] = s.nbytes()
        return sum(seen.values())

    groups = getattr(model, "groups", [])  # a ZeroDataParallel's flat groups
    params = list(model.parameters()) + [g.shard for g in groups] + optimizer_params(optimizer)
    grads = ([p.grad for p in model.parameters()] + [g.buffer for g in groups] + [g.grad_shard for g in groups]
             + [p.grad for p in optimizer_params(optimizer)])
    states = [v for st in optimizer.state.values() for k, v in st.items()
              if torch.is_tensor(v) and k != "step"]
    return {"params": total(params), "grads": total(grads), "optimizer": total(states)}


def optimizer_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]
