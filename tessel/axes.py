"""The names of the device mesh's axes, defined once (torch-free: the config and the planner use them).

pp (pipeline stages), dp (data-parallel replicas), ep (expert shards), tp
(tensor shards). Their order here is the default rank order: pp outermost, tp
innermost, so that a tensor-parallel group is a run of neighbouring ranks (one
node) and pipeline stages cross nodes (Narayanan et al. 2021, "PTD-P").
"""

from __future__ import annotations

from typing import Literal

Axis = Literal["pp", "dp", "ep", "tp"]
AXES: tuple[Axis, ...] = ("pp", "dp", "ep", "tp")
