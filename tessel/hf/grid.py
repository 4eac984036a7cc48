"""Whether a tp grid (2D, 2.5D, 3D) can place a Hugging Face model: read from the model its own plan builds.

The grid places a family from the rules 1D tensor parallelism derives from transformers' base_model_tp_plan
(tessel.hf.layout, without the family's notes: the plan's own gathered fused projections), each style mapped to
a grid layer (tessel.parallel.tensor_nd.apply): a row or column split becomes the grid's linear layer, the
embedding and head the grid's, a norm the grid's RMSNorm or the module run whole over the hidden split, a
gathered region or a per-head module the module itself (tessel.parallel.tensor_nd.whole). So the model is built
on the meta device (the one the tp, pp, ep and cp checks read) and refused, naming the module and the dimension,
where the grid's shapes cannot hold it:

- what 1D cannot place, the grid cannot either (tessel.hf.layout.tp_problem);
- an MoE block is computed whole on every rank of the grid, on the whole micro-batch, as 1D computes it on
  every tp rank (its experts are not split over ep under a grid: tessel.config refuses ep > 1 there);
- a layer the plan splits must be a torch Linear ([out, in]; GPT-2's Conv1D is not), its input and output
  features divided by the grid's side; a bias is split in side^2 pieces of its outputs (2D, 2.5D; the cube's
  linear takes none);
- a projection 1D runs whole before the split by heads (latent attention's down projections) has no grid layer;
- the token embedding must be nn.Embedding or transformers' scaled word embedding.

The hidden size, heads, kv heads, feed-forward and vocabulary against the side are tessel.config's
(tp_grid_refusal), from the shape the config filled in.
"""

from __future__ import annotations

import fnmatch
import functools
import json

from tessel.hf.layout import PlanNotes, cached_meta_model, rules_from_plan, tp_cut, tp_problem


def hf_grid_refusal(doc: dict, mode: str, side: int) -> str | None:
    """Why tp_mode `mode` on a grid of side `side` cannot place the model the config.json `doc` builds (one line
    naming the module and the dimension), or None."""
    why = tp_problem(doc)
    if why is not None:
        return why
    return _problem(json.dumps(doc, sort_keys=True), mode, side)


@functools.lru_cache(maxsize=32)
def _problem(doc_json: str, mode: str, side: int) -> str | None:
    model = cached_meta_model(doc_json)
    rules = rules_from_plan(model, tp_cut(model), PlanNotes())
    return (_embedding_problem(model, rules.embedding) or _whole_linear_problem(model, rules)
            or _linear_problem(model, rules, mode, side))


def _embedding_problem(model, name: str) -> str | None:
    emb = model.get_submodule(name)
    forward = type(emb).forward  # torch's own nn.Embedding.forward, read without importing torch
    plain = (forward.__module__, forward.__qualname__) == ("torch.nn.modules.sparse", "Embedding.forward")
    if not plain and not (type(emb).__name__.endswith("ScaledWordEmbedding") and hasattr(emb, "embed_scale")):
        return f"the grid's embedding splits nn.Embedding and transformers' scaled word embeddings, not {name} " \
               f"({type(emb).__name__}, which computes its own forward)"
    return None


def _whole_linear_problem(model, rules) -> str | None:
    """A projection 1D runs whole on every rank before its region's split by heads (multi-head latent attention's
    down projections: tessel.hf.layout's sum_grads on a Linear): the grid's residual stream is split in hidden
    chunks, and the grid has no layer that runs a projection whole on the gathered stream."""
    whole = [p for p, style in rules.linear if style == "sum_grads"]
    for name, module in model.named_modules():
        if any(fnmatch.fnmatchcase(name, p) for p in whole) and _is_torch_linear(module):
            return (f"the grid cannot place {name}: a projection 1D tensor parallelism runs whole before the split "
                    f"by heads (latent attention), which the grid's hidden split does not hold; use tp_mode '1d'")
    return None


def _linear_problem(model, rules, mode: str, side: int) -> str | None:
    """The first layer the plan splits that the grid's linear layer cannot hold, by name and dimension."""
    split = [p for p, style in rules.linear if style != "sum_grads"] + [rules.head]
    for name, module in model.named_modules():
        if not any(fnmatch.fnmatchcase(name, p) for p in split):
            continue
        if not _is_torch_linear(module):
            return f"the grid splits torch Linear layers ([out, in] weights), not {name} ({type(module).__name__})"
        for dim, size in (("in_features", module.in_features), ("out_features", module.out_features)):
            if size % side:
                return f"{name}.{dim} ({size}) must be divisible by the grid's side {side}"
        if module.bias is not None and mode == "3d":
            return f"{name} has a bias, which the 3D cube's linear layer does not take (2d and 2.5d split it)"
        if module.bias is not None and module.out_features % side ** 2:
            return f"{name}.out_features ({module.out_features}) must be divisible by {side ** 2}: the grid " \
                   f"splits its bias in {side ** 2} pieces"
    return None


def _is_torch_linear(module) -> bool:
    """A torch Linear or a subclass ([out, in] weights; GPT-2's Conv1D is not), read without importing torch."""
    return "Linear" in [c.__name__ for c in type(module).__mro__]
