"""1D tensor parallelism's apply step (Megatron TP, and sequence parallelism): the first of tessel.apply's order.

The model family's plan (tessel.models.family: the reference GPT's is
tessel.models.plan's; a Hugging Face model's is derived from its config's
base_model_tp_plan and its family's rules, tessel.models.hf.tp_plan, and must
place every parameter) says which module takes which style; the loss becomes
vocab-parallel. The 2D / 2.5D / 3D modes are tessel.parallel.tensor_nd.apply's.
"""

from __future__ import annotations

from tessel.config import ParallelConfig
from tessel.mesh import Mesh
from tessel.models.family import ModelFamily
from tessel.parallel.plan import Plan
from tessel.parallel.tensor.regions import refuse_own_loss
from tessel.parallel.tensor.tensor_parallel import FullLogits, GatherVocab, TPContext, VocabParallelLoss, apply_plan


def apply_tensor_parallel(plan: Plan, mesh: Mesh, parallel: ParallelConfig, family: ModelFamily, vocab_size: int,
                          max_seq_len: int) -> Plan:
    """tp > 1 in 1D: the family's plan applied to the model's modules, in place."""
    if mesh.size("tp") == 1 or parallel.tp_mode != "1d":
        return plan
    ctx = TPContext.from_mesh(mesh, parallel.sequence_parallel, overlap=parallel.tp_overlap)
    tp_plan = family.tp_plan(plan.model)
    apply_plan(plan.model, tp_plan.styles, ctx, place_all=family.tp_places_all, widths=tp_plan.widths,
               blocks=tp_plan.blocks)
    if family.owns_loss:  # its loss on vocab-sharded logits would be wrong
        refuse_own_loss(plan.model)
    plan.loss_fn = VocabParallelLoss(ctx, vocab_size)
    plan.full_logits = FullLogits(plan.model, ctx, vocab_size, max_seq_len)
    plan.gather_vocab = GatherVocab(ctx)
    return plan
