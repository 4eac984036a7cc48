"""How tensor parallelism splits a Hugging Face family: transformers' own plan, mapped onto tessel's.

transformers declares, for most families, which modules of the base model are
split and how: `config.base_model_tp_plan`, module patterns under the base
model ("layers.*.self_attn.q_proj" -> "colwise"). tessel reads it from the
model's own config and maps it onto its styles
(tessel.parallel.tensor.tensor_parallel.STYLES): colwise and rowwise; the
gathering variants (colwise_gather_output, then rowwise_split_input: OLMo 2's
q, k and v, whose norms span every head, and Phi-3's fused projections), after
which the module between them sees whole tensors; and
replicated_with_grad_allreduce (Qwen3's per-head q/k norms, which each rank
applies to its own heads: their gradients are summed over tp). Then it adds
what that plan leaves to transformers' runtime, from the model's structure and
its pipeline plan (tessel.models.hf.pp_plan):

- "enter" on the module around each group of column-parallel layers (the
  attention, the MLP): one Megatron f, or one sequence all-gather, shared by q,
  k and v, or by gate and up;
- the vocabulary-parallel embedding (the pipeline plan's part taking the token
  ids), whose output stays whole (the model reads its positions and causal
  mask from it), and the vocabulary-parallel head, whose logits stay split for
  tessel's vocab-parallel loss (transformers' "colwise_gather_output" would
  gather them); what the model does to them after the head (Gemma 2's
  soft-capping, Granite's scaling) is elementwise, so it is as right on a
  shard as on the whole;
- the norms of each decoder layer, outside the attention and the MLP, which
  run on sequence shards under sequence parallelism; the first decoder layer,
  where the sequence is split; and the final norm (the pipeline plan's part
  after the layers), whose output is the whole sequence again and enters the
  head's region;
- a module with weights inside a region the plan does not name (OLMo 2's q/k
  norms) is left whole where the region's projections gather their outputs
  (every rank computes it on the same whole tensor), and refused otherwise.

What a plan does not say, a family's notes (PlanNotes, in
tessel.models.hf.families) add, each checked against the plan: a fused
projection split block by block (Phi-3's qkv_proj, where the plan gathers it
whole), modules computed whole on every rank (Mixtral's MoE block, whose
experts go to the ep axis). A family without a plan at all (GPT-2) brings all
its rules here (GPT2_TP): its Conv1D layers (weight [in, out]) and its fused
q|k|v projection, split per head ("colwise_qkv"). This file must not import
tessel.parallel.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

import torch.nn as nn

from tessel.models.parts import ModelParts

# transformers' styles (base_model_tp_plan) -> tessel's
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_gather",
             "rowwise_split_input": "rowwise_split", "replicated_with_grad_allreduce": "sum_grads"}
COLUMN = ("colwise", "colwise_qkv", "colwise_packed", "colwise_gather")  # their enclosing module enters the region
GATHERED = ("colwise_gather",)  # column styles whose output the module around them sees whole


@dataclass(frozen=True)
class TPRules:
    """A family's tensor-parallel rules: module name patterns (fnmatch, whole name)."""
    embedding: str  # the token embedding: vocabulary-parallel, whole output
    first_layer: str  # where the sequence is split under sequence parallelism
    norms: tuple[str, ...]  # in the decoder layers: run on sequence shards under sequence parallelism
    final_norm: str  # the last norm: sequence shards in, the whole sequence out, into the head's region
    head: str = "lm_head"  # vocabulary-parallel (entered at final_norm); tied to the embedding if the model ties them
    linear: tuple[tuple[str, str], ...] = ()  # pattern -> style of the projections (and per-head norms)
    replicated: tuple[str, ...] = ()  # computed whole on every tp rank (MoE blocks)
    kept: tuple[str, ...] = ()  # parameters left whole (position embeddings; norms inside a gathered region)
    widths: tuple[tuple[str, tuple[str, ...]], ...] = ()  # pattern -> attributes holding a width tp divides
    blocks: tuple[tuple[str, tuple[int, ...]], ...] = ()  # "colwise_packed" pattern -> its blocks' relative sizes
    # the base model reshapes its final norm's output to its input's (B, T) (GPT-2): under sequence parallelism
    # a pipeline stage before the last makes the sequence whole there and sends its own shard
    reshapes_output: bool = False


@dataclass(frozen=True)
class PlanNotes:
    """What a family's base_model_tp_plan does not say, as keys of that plan (patterns under the base model).

    linear: keys whose style tessel refines (each must be in the plan): a fused projection the plan gathers
    whole, split block by block instead ("colwise_packed", its blocks' relative sizes in `blocks`, as ints
    or names of config attributes: Phi-3's q|k|v in heads), and the row-parallel layer after it then takes
    its input split. widths: attributes a module computes its local shapes from, divided by tp
    ("config.<name>": read from its config). replicated: modules every tp rank computes whole (an MoE block),
    whose entries in the plan are left out.
    """
    linear: tuple[tuple[str, str], ...] = ()
    blocks: tuple[tuple[str, tuple[int | str, ...]], ...] = ()
    widths: tuple[tuple[str, tuple[str, ...]], ...] = ()
    replicated: tuple[str, ...] = ()


GPT2_TP = TPRules(
    embedding="transformer.wte", first_layer="transformer.h.0",
    norms=("transformer.h.*.ln_1", "transformer.h.*.ln_2"), final_norm="transformer.ln_f",
    linear=(("transformer.h.*.attn.c_attn", "colwise_qkv"), ("transformer.h.*.attn.c_proj", "rowwise"),
            ("transformer.h.*.mlp.c_fc", "colwise"), ("transformer.h.*.mlp.c_proj", "rowwise")),
    kept=("transformer.wpe",),
    widths=(("transformer.h.*.attn", ("split_size",)),),  # it splits c_attn's output at the whole width
    reshapes_output=True)


@dataclass(frozen=True)
class TPPlan:
    """What tessel.parallel.tensor.tensor_parallel.apply_plan takes."""
    styles: dict[str, str]  # module pattern -> style
    widths: dict[str, tuple[str, ...]]  # module pattern -> attributes divided by tp
    blocks: dict[str, tuple[int, ...]]  # "colwise_packed" module pattern -> its blocks' relative sizes


def hf_tp_plan(model: nn.Module, rules: TPRules | None) -> TPPlan:
    """The plan for a transformers causal LM: its rules (rules_from_plan's, or GPT-2's own) as styles.

    rules None (an architecture tessel has no rules for): only what transformers' plan says, so that
    apply_plan(place_all=True) names the first module nobody placed.
    """
    if rules is None:
        linear = plan_styles(model, PlanNotes())
        return TPPlan({**{_parent(p): "enter" for p, s in linear.items() if s in COLUMN}, **linear}, {}, {})
    linear = dict(rules.linear)
    styles = {_parent(pattern): "enter" for pattern, style in linear.items() if style in COLUMN}
    styles.update({rules.embedding: "vocab_embedding_whole", rules.first_layer: "split_sequence"})
    styles.update({pattern: "sequence_norm" for pattern in rules.norms})
    styles[rules.final_norm] = "final_norm"
    styles.update({pattern: "replicate" for pattern in rules.replicated})
    styles.update({pattern: "keep" for pattern in rules.kept})
    styles.update(linear)
    styles[rules.head] = "vocab_head_entered"
    return TPPlan(styles, dict(rules.widths), dict(rules.blocks))


def plan_styles(model: nn.Module, notes: PlanNotes) -> dict[str, str]:
    """Pattern (under the model) -> tessel style, from the config's base_model_tp_plan refined by `notes`;
    ValueError naming a style tessel does not map, or a note the plan does not have."""
    theirs = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    unknown = [key for key, _ in notes.linear if key not in theirs]
    if unknown:
        raise ValueError(f"the family's notes refine {unknown}, which {type(model).__name__}'s base_model_tp_plan "
                         "does not name")
    prefix, out = model.base_model_prefix, {}
    for key, style in {**theirs, **dict(notes.linear)}.items():
        if any(fnmatch.fnmatchcase(key, r) or key.startswith(r + ".") for r in notes.replicated):
            continue  # inside a module every tp rank computes whole
        if key in dict(notes.linear):
            out[f"{prefix}.{key}"] = style  # already tessel's
        elif style in HF_STYLES:
            out[f"{prefix}.{key}"] = HF_STYLES[style]
        else:
            raise ValueError(f"transformers' tensor-parallel plan asks {style!r} of '{prefix}.{key}', which tessel "
                             f"does not map (it maps {', '.join(sorted(HF_STYLES))})")
    return out


def rules_from_plan(model: nn.Module, parts: ModelParts, notes: PlanNotes) -> TPRules:
    """A family's rules from its base_model_tp_plan, its pipeline parts (embedding, layers, final norm, head:
    tessel.models.hf.pp_plan) and the modules of its decoder layers; ValueError naming the first module
    neither the plan nor the model's structure places."""
    prefix = model.base_model_prefix
    linear = plan_styles(model, notes)
    replicated = tuple(f"{prefix}.{r}" for r in notes.replicated)
    norms, kept = _layer_modules(model, parts.blocks, linear, replicated)
    final = parts.after[:-1]  # the head is last
    if len(final) != 1:
        raise ValueError(f"{type(model).__name__}'s pipeline plan has {list(final)} between its layers and its "
                         "head; tensor parallelism expects one final norm there")
    return TPRules(embedding=parts.before[0], first_layer=f"{parts.blocks}.0", norms=norms, final_norm=final[0],
                   head=parts.after[-1], linear=tuple(linear.items()), replicated=replicated, kept=kept,
                   widths=tuple((f"{prefix}.{k}", v) for k, v in notes.widths),
                   blocks=tuple((f"{prefix}.{k}", _sizes(model, v)) for k, v in notes.blocks))


def _layer_modules(model: nn.Module, blocks: str, linear: dict[str, str],
                   replicated: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(norms, kept): patterns of the modules with weights in the decoder layers that the plan does not name.
    Outside the regions of column-parallel layers, a norm (it runs on sequence shards under sequence
    parallelism); inside a region whose column layers gather their outputs, a module every rank computes on
    the same whole tensor (kept whole). Anything else is refused by name."""
    regions = {_parent(p): [] for p, s in linear.items() if s in COLUMN}
    for p, s in linear.items():
        if s in COLUMN:
            regions[_parent(p)].append(s)
    norms, kept = {}, {}
    for name, module in model.get_submodule(blocks).named_modules(prefix=blocks):
        if next(module.parameters(recurse=False), None) is None or _named(name, (*linear, *replicated)):
            continue
        pattern = f"{blocks}.*.{name[len(blocks) + 1:].partition('.')[2]}"
        region = next((r for r in regions if _named(name, (r,))), None)
        if region is None and _is_norm(module):
            norms[pattern] = None
        elif region is not None and all(s in GATHERED for s in regions[region]):
            kept[pattern] = None
        else:
            where = "outside the attention and the MLP, and not a norm" if region is None else \
                f"inside {region}, whose projections the plan splits by heads, and the plan does not name it"
            raise ValueError(f"tensor parallelism cannot place '{name}' ({type(module).__name__}): {where}")
    return tuple(norms), tuple(kept)


def _named(name: str, patterns) -> bool:
    """Whether a pattern names the module or one above it."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), p) for p in patterns for i in range(1, len(parts) + 1))


def _is_norm(module: nn.Module) -> bool:
    """A per-token norm: its class says so and its weights are per channel (1-D)."""
    return "Norm" in type(module).__name__ and all(p.dim() == 1 for p in module.parameters(recurse=False))


def _sizes(model: nn.Module, sizes: tuple[int | str, ...]) -> tuple[int, ...]:
    return tuple(s if isinstance(s, int) else int(getattr(model.config, s)) for s in sizes)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]
