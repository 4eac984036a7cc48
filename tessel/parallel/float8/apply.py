"""tessel.apply's step for train.precision = "fp8": the blocks' linear layers multiply in float8.

Which layers: every linear layer inside the family's decoder layers (attention's projections, the MLP, a
Hugging Face MoE's experts where they are nn.Linear), on the shards this rank holds after TP/SP, CP, EP and the
pipeline's cut. Not the embedding, the head (the logits' precision decides the loss), the norms, nor a router:
a router's scores choose experts, and Switch and DeepSeek-V3 keep routing in high precision (tessel's own
router already computes in fp32; a Hugging Face router, an nn.Linear named `gate` or `router`, is left in
bf16). A layer whose dimensions are not multiples of 16 stays in bf16 (float8 GEMMs need them).

After this step come recompute and compile (torchao's casts compile into the blocks' graphs, as torchtitan
orders them) and DP/ZeRO, whose hooks see the same parameters as in bf16.
"""

from __future__ import annotations

import torch.nn as nn

from tessel.config import TrainConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.parallel.plan import Plan
from tessel.parallel.tensor.tensor_parallel import ColumnParallelLinear, RowParallelLinear

ROUTER_NAMES = ("gate", "router", "shared_expert_gate")  # a Hugging Face MoE's routers: kept in bf16


def apply_float8(plan: Plan, mesh: Mesh, train: TrainConfig, family: ModelFamily) -> Plan:
    if train.precision != "fp8":
        return plan
    from tessel.parallel.float8.device import multiplies_in_float8  # deferred: torchao loads only for fp8
    from tessel.parallel.float8.matmul import Float8Matmul, fits_float8, linear_forward  # deferred: torchao
    matmul = Float8Matmul(train.fp8_recipe, emulate=not multiplies_in_float8(mesh.device))
    stages = list(plan.model) if mesh.size("pp") > 1 else [plan.model]  # a pipeline rank's chunks
    for layer in (layer for stage in stages for layer in family.decoder_layers(stage)):
        for module in float8_layers(layer):
            if not fits_float8(module.weight):
                continue
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                module.matmul = matmul
            else:
                module.forward = linear_forward(module, matmul)
    return plan


def float8_layers(layer: nn.Module) -> list[nn.Module]:
    """A decoder layer's linear layers that multiply in float8 (not its routers)."""
    kinds = (nn.Linear, ColumnParallelLinear, RowParallelLinear)
    return [m for name, m in layer.named_modules()
            if isinstance(m, kinds) and name.rsplit(".", 1)[-1] not in ROUTER_NAMES]
