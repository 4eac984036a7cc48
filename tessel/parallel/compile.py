"""train.compile: torch.compile of each transformer block ("blocks", regional compilation) or of the whole
model, each pipeline chunk on its own ("model").

The choices, and why:

- Where: tessel.apply runs this after TP/SP, CP, EP, the pipeline split and recompute, and before DP/ZeRO,
  as torchtitan orders it. What is compiled is the block as this rank runs it (its shards, its
  checkpoint), and the hooks of ZeRO and DP (stage 3's gather before a block and free after it, the
  bucketed gradient all-reduce) stay eager around the compiled forward: their collectives overlap compute
  as they do without compilation.
- How: the forward is compiled on the instance (`module.forward = ...`, as recompute replaces it). Neither
  `torch.compile(module)`, an OptimizedModule that puts `_orig_mod.` into every parameter and checkpoint
  name, nor `nn.Module.compile()`, which compiles `_call_impl` and so traces the module's hooks (ZeRO-3's
  storage resizes and parameter class switches) into the graph. Names do not change; hooks run eagerly.
- One graph per kind of block: dynamo keys its cache on the forward's code, and with
  `inline_inbuilt_nn_modules` (torch's default) a block's parameters are inputs of the graph, not
  constants, so every block of one class passes the first one's guards and reuses its graph.
- No recompilation: `dynamic=False`, since a training step's shapes are fixed; a layout whose shapes
  change would recompile, and the tests count that none does after the first step. Without gradients
  (evaluation, sampling) the eager forward runs: sampling's window grows a token at a time, which would
  compile one graph per length (or a dynamic-shape graph), and evaluation's graph differs from
  training's (no autograd), while both are a small part of a run.
- Data-dependent modules run eagerly inside a compiled block (`torch.compiler.disable`): an MoE layer's
  routing (which rows go to which expert, the all-to-all's split sizes) and Mixtral's experts have
  shapes that change with every batch, so a compiled version would recompile on each new routing. The
  block compiles as two graphs around it.
"""

from __future__ import annotations

import torch
import torch.nn as nn


class TrainingForward:
    """A module's forward compiled for training; the eager one where no gradient is taken (see above)."""

    def __init__(self, forward, backend: str):
        self.eager = forward
        self.compiled = torch.compile(forward, backend=backend, dynamic=False)

    def __call__(self, *args, **kwargs):
        if torch.is_grad_enabled():
            return self.compiled(*args, **kwargs)
        return self.eager(*args, **kwargs)


def compile_forwards(modules: list[nn.Module], backend: str) -> None:
    """Compile each module's forward on the instance (its names and hooks unchanged)."""
    for module in modules:
        if not isinstance(module.forward, TrainingForward):
            module.forward = TrainingForward(module.forward, backend)


def run_eagerly(modules: list[nn.Module]) -> None:
    """These modules' forwards stay eager inside a compiled region (a graph break around each)."""
    for module in modules:
        module.forward = torch.compiler.disable(module.forward, recursive=True)


def without_kv_cache(model: nn.Module) -> None:
    """A Hugging Face model called without its key/value cache (transformers makes one in training too, from
    config.use_cache): tessel never reads it (sampling runs whole windows), and each layer's update of it
    is Python state that dynamo cannot trace inside a checkpointed layer."""
    model.register_forward_pre_hook(_no_cache, with_kwargs=True)


def _no_cache(module: nn.Module, args: tuple, kwargs: dict):
    return args, {**kwargs, "use_cache": False}
