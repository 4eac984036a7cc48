"""The names of the device mesh's axes, defined once (torch-free: the config and the planner use them).

pp (pipeline stages), dp (data-parallel replicas), ep (expert shards), cp
(context shards: chunks of the same sequences), tp (tensor shards). Their order
here is the default rank order: pp outermost, tp innermost, so that a
tensor-parallel group is a run of neighbouring ranks (one node) and pipeline
stages cross nodes (Narayanan et al. 2021, "PTD-P"). cp sits next to tp, inside
a node while cp*tp fits one, as Megatron-Core orders them (tp-cp-ep-dp-pp): its
ring passes keys and values every layer, second only to tp's all-reduces.
"""

from __future__ import annotations

from typing import Literal, Sequence

Axis = Literal["pp", "dp", "ep", "cp", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "ep", "cp", "tp")
# The axes whose ranks see different tokens: losses, and the gradients of weights they replicate, are
# averaged over them. dp and ep split the batch; cp splits each sequence (every cp rank holds chunks of
# the same samples), so its ranks' losses and gradients are partial sums like dp's.
TOKEN_AXES: tuple[Axis, ...] = ("dp", "ep", "cp")


def full_order(order: Sequence[str]) -> tuple[str, ...]:
    """A rank order written before cp existed (a permutation of pp, dp, ep, tp) gets cp just outside tp."""
    order = tuple(order)
    if "cp" in order or "tp" not in order:
        return order
    at = order.index("tp")
    return (*order[:at], "cp", *order[at:])
