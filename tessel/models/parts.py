"""Where a model keeps what a pipeline cuts, by module name: data, as a tensor-parallel plan is.

A pipeline stage is the model itself with the modules it does not own removed
(tessel.parallel.pipeline.partition), and the model's own forward runs it. That
works when the forward copes with what is absent, and ModelParts says how:

- the reference GPT's forward skips a module set to None and takes hidden
  states where the token ids went;
- a Hugging Face causal LM's forward does not skip: its final norm and head are
  called unconditionally, so on a stage before the last they are stood in for
  by modules that pass hidden states through; a stage after the first gets its
  hidden states as `inputs_embeds`, which the model then uses in place of its
  token embedding; what the model adds to the input embeddings (GPT-2's
  position embedding) must add nothing there, and what it applies to them
  (GPT-2's embedding dropout) must pass them through.

The decoder-layer list keeps its entries under their indices in the full
model, and the model iterates whatever entries are left, so a stage's
parameters carry the full model's names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn as nn


class AddsNothing(nn.Module):
    """Stands in for a module whose output the model adds to the hidden states (GPT-2's position
    embedding, on a stage that receives hidden states which already include it): a zero."""

    def forward(self, *args: torch.Tensor, **kwargs) -> torch.Tensor:
        device = next((a.device for a in args if isinstance(a, torch.Tensor)), None)
        return torch.zeros((), device=device)  # x + 0 == x exactly; a 0-dim tensor keeps x's dtype


class PassesHidden(nn.Module):
    """Stands in for a decoder layer another stage holds, under its index (parts that hand over at the blocks):
    returns the hidden states it is called with, so that a model that picks each layer's mask by its position
    in the list (Gemma 2: layer_types[i]) still gives every real layer its own."""

    def forward(self, *args, **kwargs):
        return args[0] if args else kwargs["hidden_states"]


STAND_INS = {
    "pass": nn.Identity,  # returns its input: a final norm or head before the last stage, an input dropout
    "zero": AddsNothing,  # returns 0: an embedding added to the input embeddings after the first stage
}


@dataclass(frozen=True)
class ModelParts:
    """The parts of a model a pipeline distributes, by module name.

    `before` runs ahead of the blocks (on the first stage), `after` behind them
    (on the last); `blocks` is the list of blocks; `tied` names the input
    embedding's and the output head's weight, one tensor when they are tied.
    `stand_ins` says what a removed module becomes ("pass" or "zero", see
    STAND_INS); one not named there becomes None (or leaves its container).
    `hidden_input` is the keyword a stage after the first gets its hidden
    states by (None: in the token ids' place). `hand_over_at_blocks`: stages
    hand their hidden states over at the blocks themselves: a later stage's
    first block takes what the stage receives, unchanged, and an earlier stage
    sends its last block's output, so that whatever the model does to its
    input embeddings (a multiplier) or to its head's output (soft-capping)
    runs once, on the first or the last stage (tessel.models.hf.pp_plan); the
    blocks a stage does not hold then stay in its list as PassesHidden.
    """
    before: tuple[str, ...] = ("tok_emb",)
    blocks: str = "layers"
    after: tuple[str, ...] = ("norm", "lm_head")
    tied: tuple[str, str] = ("tok_emb.weight", "lm_head.weight")
    stand_ins: dict[str, str] = field(default_factory=dict)
    hidden_input: str | None = None
    hand_over_at_blocks: bool = False

    def stand_in(self, name: str) -> nn.Module | None:
        """What a stage that does not own module `name` holds in its place."""
        kind = self.stand_ins.get(name)
        return STAND_INS[kind]() if kind is not None else None

    def held_blocks(self, model: nn.Module) -> list[nn.Module]:
        """The blocks a model (or a pipeline stage of it) holds, in order, without stand-ins."""
        return [b for b in model.get_submodule(self.blocks) if not isinstance(b, PassesHidden)]

    def unplaced(self, model: nn.Module) -> list[str]:
        """'name (Class)' of each module holding a parameter that no part holds: a stage cut by these
        names would either lose it or hold a copy on every stage, trained apart."""
        owners = (*self.before, self.blocks, *self.after)
        out = []
        for name, module in model.named_modules():
            if any(True for _ in module.parameters(recurse=False)) and not any(
                    name == o or name.startswith(o + ".") for o in owners):
                out.append(f"{name or '(the model itself)'} ({type(module).__name__})")
        return out


GPT_PARTS = ModelParts()  # tessel.models.gpt.GPT: its forward skips what is None
