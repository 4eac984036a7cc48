"""Stages that hand their hidden states over at the blocks (ModelParts.hand_over_at_blocks).

A Hugging Face model's forward does things between its parts that no plan
names: Gemma multiplies its embeddings, Granite too, Gemma 2 soft-caps its
logits, Granite divides them. A stage that took its hidden states as
`inputs_embeds` would multiply them again; a stage before the last would send
its hidden states soft-capped by the stand-in head's caller. So the hand-over
happens at the blocks:

- a stage after the first gives what it receives to its first block, unchanged
  (a pre-hook on that block); the model itself gets a tensor of the whole
  input's shape as `inputs_embeds`, from which it reads only its positions and
  causal mask (its values reach nothing: the first block's input is replaced);
- a stage before the last returns its last block's output (a forward hook on
  that block keeps it, one on the stage returns it), whatever the model does
  after it.

Under sequence parallelism stages exchange sequence shards (B, T/tp, C): the
first block takes the shard as it is (no split: it is already this rank's),
and the model gets a tensor of the whole sequence's shape, so no collective
runs at the hand-over. A block's input is found by position or by name (a
decoder layer called with keywords), as tensor parallelism's hooks find it.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tessel.parallel.tensor.regions import input_name


class HandOver:
    """The hooks of one stage; `keyword` is the one the stage's hidden states arrive by (after
    partition.HiddenStatesAs moved them there), `seq_dim`/`shards` the sequence split a shard carries."""

    def __init__(self, keyword: str, shards: int = 1, seq_dim: int = 1):
        self.keyword, self.shards, self.seq_dim = keyword, shards, seq_dim
        self.received: torch.Tensor | None = None
        self.last_output: torch.Tensor | None = None

    def attach(self, stage: nn.Module, blocks: list[nn.Module], first: bool, last: bool) -> None:
        if not first:
            stage.register_forward_pre_hook(self._take, with_kwargs=True)
            self._block_input = input_name(blocks[0])
            blocks[0].register_forward_pre_hook(self._give, with_kwargs=True)
        if not last:
            blocks[-1].register_forward_hook(self._keep)
            stage.register_forward_hook(self._send)

    def _take(self, stage: nn.Module, args: tuple, kwargs: dict):
        hidden = kwargs[self.keyword]
        self.received = hidden
        shape = list(hidden.shape)
        shape[self.seq_dim] *= self.shards
        # what the model measures: the whole input's shape; its values are never read (see _give)
        stand_in = hidden.detach() if self.shards == 1 else hidden.new_zeros(shape)
        return args, {**kwargs, self.keyword: stand_in}

    def _give(self, block: nn.Module, args: tuple, kwargs: dict):
        hidden, self.received = self.received, None
        if hidden is None:
            raise RuntimeError("a stage's first block ran without the hidden states the stage received")
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, self._block_input: hidden}

    def _keep(self, block: nn.Module, args: tuple, output):
        self.last_output = output[0] if isinstance(output, tuple) else output

    def _send(self, stage: nn.Module, args: tuple, output):
        out, self.last_output = self.last_output, None
        return out
