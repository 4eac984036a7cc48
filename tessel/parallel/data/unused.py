"""Parameters no rank used: their gradient travels as negative zero, and stays None.

A parameter that takes no part in a forward gets no gradient, and torch's
optimizers skip a parameter whose .grad is None (AdamW neither decays it nor
counts its step). Data parallelism must keep that: a parameter unused on every
rank keeps grad None on every rank, and one used on some ranks only gets the
reduced gradient on all of them. DDP finds the globally unused parameters with
one more all-reduce, of a bitmap of the parameters each rank used (Li et al.
2020, "PyTorch Distributed", find_unused_parameters).

tessel carries that bit inside the gradient reduction itself: a rank that has no
gradient for a parameter contributes -0.0 in every element. In IEEE arithmetic
(round to nearest) x + (-0.0) == x for every x, +0.0 included, and
(-0.0) + (-0.0) == -0.0, while values that cancel sum to +0.0; dividing by the
number of ranks and casting between float dtypes keep the sign. So an element
of a reduced (summed, in any order or algorithm) gradient is -0.0 exactly when
every rank contributed -0.0, and the parameter whose every element is -0.0 was
used by no rank. That costs no collective and no byte beyond the gradients, so a
step issues what the planner prices (tessel.planner.traffic).

A gradient that autograd computed is not -0.0 in every element: kernels sum from
+0.0 (torch.tensor([-0., -0.]).sum() is +0.). A parameter whose computed
gradient is -0.0 everywhere on every rank would be taken as unused, which
differs from DDP only in that AdamW skips a step whose gradient is exactly zero.
A backend that turned -0.0 into +0.0 would give today's zero gradient instead
of None, never the reverse.

Finding a gradient that is -0.0 everywhere means reading it on the host: on a
GPU one wait for the device per step. A model whose every forward uses every
parameter (one without experts: its family's uses_every_parameter,
tessel.models.family) has none to find, so the DP/ZeRO step marks its
parameters `always_used` and the check skips them: its steps read nothing on
the host. Its reductions still carry -0.0 for a parameter a rank did not use,
so the marks change no gradient.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

NO_GRADIENT = -0.0  # what a rank without a gradient for a parameter contributes, per element


def mark_no_gradient(t: torch.Tensor) -> torch.Tensor:
    """Fill t (a gradient view, a reduction buffer) with "no gradient here"."""
    return t.fill_(NO_GRADIENT)


def mark_always_used(params: Iterable[torch.Tensor]) -> None:
    """Every forward gives these parameters a gradient: no step asks whether one went unused (see above)."""
    for p in params:
        p.tessel_always_used = True


def may_go_unused(p: torch.Tensor) -> bool:
    """Whether a step must ask if p went without a gradient (not marked always used)."""
    return not getattr(p, "tessel_always_used", False)


def no_gradient(grads: Sequence[torch.Tensor]) -> list[bool]:
    """For each reduced gradient: whether it is -0.0 everywhere (no rank had a gradient).

    One host sync for all of them: first elements decide for almost every gradient,
    and only those that start with -0.0 are read whole."""
    flags = [False] * len(grads)
    nonempty = [i for i, g in enumerate(grads) if g.numel()]
    if not nonempty:
        return flags
    firsts = torch.cat([grads[i].reshape(-1)[:1] for i in nonempty])
    for k in _negative_zero(firsts).nonzero().flatten().tolist():
        i = nonempty[k]
        flags[i] = bool(_negative_zero(grads[i]).all())
    return flags


def _negative_zero(t: torch.Tensor) -> torch.Tensor:
    return (t == 0) & torch.signbit(t)
