"""What the apply steps ask of a model's family: the reference GPT's answers, or a Hugging Face family's.

tessel.parallel's steps (tessel/parallel/<strategy>/apply.py) act on these facts;
a family only says what its model is (which modules take which tensor-parallel
style, where a pipeline cuts it, which modules are its decoder layers, whether it
scores itself, its router loss), so this file imports nothing of tessel.parallel.
`model_family` chooses the implementation once, from the model's config section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch.nn as nn

from tessel.config import ModelConfig
from tessel.hf.shape import family, read_config
from tessel.models.gpt import Block
from tessel.models.hf.families import Family, decoder_layers, family_of, pipeline_parts, tp_rules
from tessel.models.hf.moe import RouterLoss, RouterLossSpec, router_loss, router_loss_spec
from tessel.models.hf.tp_plan import PlanNotes, TPPlan, hf_tp_plan, rules_from_plan
from tessel.models.moe import MoE
from tessel.models.parts import GPT_PARTS, ModelParts
from tessel.models.plan import gpt_tp_plan


@dataclass(frozen=True)
class StageSequence:
    """How a stage of a model that measures its sequence from its input meets sequence-parallel shards (the
    pipeline's tp + SP on GPT-2's own parts): the keyword its hidden states enter by, and the final norm it
    reshapes its output at (None: it does not)."""
    hidden_input: str | None
    final_norm: str | None


class ModelFamily(Protocol):
    """The facts about a model the apply steps branch on."""

    owns_loss: bool  # its forward scores labels itself: wrong on sharded logits, so a tp layout refuses it
    tp_places_all: bool  # its tp plan is derived: 1D checks that it places every parameter before anything changes
    transformers_attention: bool  # attention through transformers' AttentionInterface (cp hooks that)
    experts_by_plan: bool  # its experts are the modules its base_model_ep_plan names (not tessel's MoE layers)
    # every forward gives every parameter a gradient (no experts, no module its forward skips): DP/ZeRO need not
    # ask which went unused, so a step reads nothing on the host (tessel/parallel/data/unused.py)
    uses_every_parameter: bool

    def tp_plan(self, model: nn.Module) -> TPPlan:
        """1D tensor parallelism's plan: module pattern -> style, and what each style needs."""

    def grid_tp_plan(self, model: nn.Module) -> dict[str, str]:
        """The styles a 2D / 2.5D / 3D grid maps to its layers."""

    def pipeline_parts(self, model: nn.Module) -> ModelParts:
        """Where a pipeline cuts the model."""

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        """Its transformer blocks (on a pipeline chunk: the ones the chunk holds): what recompute and compile
        wrap."""

    def stage_sequence(self, parts: ModelParts) -> StageSequence | None:
        """What a pipeline stage under tp + SP must make whole (None: its stages hand over at the blocks)."""

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        """The router loss its forward adds to its own loss, recorded from its routers (None: it adds none)."""

    def router_loss_spec(self, model: nn.Module) -> RouterLossSpec | None:
        """That router loss's coefficient and shape, for a pipeline's stages to add it up."""


@dataclass(frozen=True)
class GPTFamily:
    """tessel.models.gpt.GPT: its plan is tessel.models.plan's, its cut GPT_PARTS, its blocks Block."""
    n_layer: int
    uses_every_parameter: bool  # without experts (an expert may get no token)
    owns_loss: bool = False
    tp_places_all: bool = False
    transformers_attention: bool = False
    experts_by_plan: bool = False

    def tp_plan(self, model: nn.Module) -> TPPlan:
        moe_blocks = [i for i, layer in enumerate(model.layers) if isinstance(layer.mlp, MoE)]
        return TPPlan(gpt_tp_plan(moe_blocks, self.n_layer), {}, {})

    def grid_tp_plan(self, model: nn.Module) -> dict[str, str]:
        return gpt_tp_plan([], self.n_layer)

    def pipeline_parts(self, model: nn.Module) -> ModelParts:
        return GPT_PARTS

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return [m for m in model.modules() if isinstance(m, Block)]

    def stage_sequence(self, parts: ModelParts) -> StageSequence | None:
        return None  # its forward takes the sequence shards a stage receives as they are

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        return None  # its MoE blocks' aux losses are tessel's own (tessel.models.moe)

    def router_loss_spec(self, model: nn.Module) -> RouterLossSpec | None:
        return None


@dataclass(frozen=True)
class HFFamily:
    """A transformers causal LM: its family's entry (tessel.models.hf.families), its plans read from the model."""
    family: Family
    uses_every_parameter: bool  # the dense families tessel knows (another may hold a module its forward skips)
    owns_loss: bool = True
    tp_places_all: bool = True
    transformers_attention: bool = True
    experts_by_plan: bool = True

    def tp_plan(self, model: nn.Module) -> TPPlan:
        return hf_tp_plan(model, tp_rules(model, self.family))

    def grid_tp_plan(self, model: nn.Module) -> dict[str, str]:
        # without the family's notes: they split a fused projection by heads over 1D's ranks (Phi-3's), where the
        # grid takes the plan's own gathered output (its blocks' checkpoint layout on a grid is not built)
        return hf_tp_plan(model, rules_from_plan(model, PlanNotes())).styles

    def pipeline_parts(self, model: nn.Module) -> ModelParts:
        return pipeline_parts(model, self.family)

    def decoder_layers(self, model: nn.Module) -> list[nn.Module]:
        return decoder_layers(model, self.family)

    def stage_sequence(self, parts: ModelParts) -> StageSequence | None:
        if parts.hand_over_at_blocks:  # stages exchange sequence shards as they are (pipeline/handover.py)
            return None
        reshapes = self.family.tp.reshapes_output
        return StageSequence(self.family.parts.hidden_input, self.family.tp.final_norm if reshapes else None)

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        return router_loss(model)

    def router_loss_spec(self, model: nn.Module) -> RouterLossSpec | None:
        return router_loss_spec(model)


def model_family(model: ModelConfig) -> ModelFamily:
    """The family of the model the config section describes: the reference GPT, or its Hugging Face family."""
    if model.hf_config is None:
        return GPTFamily(model.n_layer, uses_every_parameter=model.n_experts == 0)
    model_type = read_config(model.hf_config)["model_type"]
    dense = family(model.hf_config) not in (None, "mixtral") and model.n_experts == 0
    return HFFamily(family_of(model_type), uses_every_parameter=dense)
