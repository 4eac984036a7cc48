"""Where a Hugging Face model's own plans put its modules: the pipeline cut and the tensor-parallel rules.

transformers declares, per family, `base_model_pp_plan` (the embedding, the list of decoder layers, what follows
them; tessel.models.hf.pp_plan), `base_model_tp_plan` (module patterns -> colwise, rowwise, ...;
tessel.models.hf.tp_plan) and, for MoE families, `base_model_ep_plan`. The rules that turn those plans and the
model's module tree into tessel's cut live here, apart from tessel.models, so that one derivation serves both
the ranks (on the model they train) and the checks tessel.config runs before any process starts (on the same
class built on the meta device: no weights, a fraction of a second, once per config). A family tessel has no
table entry for is placed by these rules alone, and refused by them, naming the module or the plan entry they
cannot place.

The module objects are read by duck typing (named_modules, parameters, class names): this file imports neither
torch nor tessel.models (tessel.config imports it).
"""

from __future__ import annotations

import fnmatch
import functools
import json
from dataclasses import dataclass

from tessel.hf.config import transformers_config
from tessel.hf.lineage import inherited_entries
from tessel.hf.region_inputs import before_split

# transformers' styles (base_model_tp_plan) -> tessel's
HF_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_gather_output": "colwise_gather",
             "rowwise_split_input": "rowwise_split", "replicated_with_grad_allreduce": "sum_grads",
             # latent attention's kv down projection (and shared rope key): whole on every rank, on the region's
             # whole input; every rank's heads hold a share of its output's gradient (its kv_b_proj's and its
             # rope key's alike, under tessel's one f at the region's entry), so all of its gradients are summed
             "mla_kv_a_proj": "sum_grads"}
COLUMN = ("colwise", "colwise_qkv", "colwise_packed", "colwise_gather")  # their enclosing module enters the region
GATHERED = ("colwise_gather",)  # column styles whose output the module around them sees whole
LINEAR_CLASSES = ("Linear", "Conv1D")  # what a row or column style splits (by class name, any subclass)
# the styles transformers gives a module of experts as a whole (tensor- and expert-parallel plans): the MoE block
# around it is computed whole on every tp rank, its experts go to the ep axis (tessel.parallel.expert)
EXPERTS = ("moe_tp_experts", "ep_dispatch_experts")


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
    ("config.<name>": read from its config).
    """
    linear: tuple[tuple[str, str], ...] = ()
    blocks: tuple[tuple[str, tuple[int | str, ...]], ...] = ()
    widths: tuple[tuple[str, tuple[str, ...]], ...] = ()


@dataclass(frozen=True)
class PipelineCut:
    """The parts of base_model_pp_plan as module names under the causal LM (tessel.models.parts.ModelParts)."""
    before: tuple[str, ...]  # the embedding first
    blocks: str  # the decoder layers
    after: tuple[str, ...]  # the head last
    hidden_input: str  # the embedding's output name: what a later stage's hidden states enter the model as


# ---- the pipeline cut ------------------------------------------------------------------------------------

def pipeline_cut(model) -> PipelineCut:
    """The cut of a transformers causal LM from its config's base_model_pp_plan; ValueError naming what the plan
    lacks where it does not describe an embedding, one list of layers and a head."""
    plan = dict(getattr(model.config, "base_model_pp_plan", None) or {})
    kind = type(model).__name__
    if not plan:
        raise ValueError(f"{kind}'s config declares no base_model_pp_plan (transformers' pipeline plan)")
    prefix = model.base_model_prefix
    base = model.get_submodule(prefix)
    names = list(plan)
    # getattr, not get_submodule: on a pipeline stage a part it does not hold is None
    lists = [n for n in names if _is_list(getattr(base, n, None))]
    if len(lists) != 1:
        raise ValueError(f"{kind}'s base_model_pp_plan names {len(lists)} lists of layers ({lists}); a pipeline "
                         "cuts one")
    at = names.index(lists[0])
    before, after = names[:at], names[at + 1:]
    if not before or list(plan[before[0]][0]) != ["input_ids"]:
        raise ValueError(f"{kind}'s base_model_pp_plan starts with no part taking input_ids (its embedding)")
    cut = PipelineCut(before=tuple(f"{prefix}.{n}" for n in before), blocks=f"{prefix}.{lists[0]}",
                      after=(*(f"{prefix}.{n}" for n in after), head_name(model)),
                      hidden_input=plan[before[0]][1][0])
    _check_cut_holds_all(model, cut)
    return cut


def _check_cut_holds_all(model, cut: PipelineCut) -> None:
    """Every module with weights lies in a part of the cut (a stage holds it or not): ValueError naming the first
    that none holds (Gemma 4's per-layer embeddings, beside the plan's parts)."""
    parts = (*cut.before, cut.blocks, *cut.after)
    for name, module in model.named_modules():
        if _has_weights(module) and not _named(name, parts):
            raise ValueError(f"pipeline parallelism cannot place {name} ({type(module).__name__}): it is in none of "
                             f"the parts of {type(model).__name__}'s base_model_pp_plan ({', '.join(parts)})")


def tp_cut(model) -> PipelineCut:
    """Where tensor parallelism finds the embedding, the decoder layers, the final norm and the head: the pipeline
    plan's cut, or for a model whose config declares none, its structure (structural_cut)."""
    if not getattr(model.config, "base_model_pp_plan", None):
        return structural_cut(model)
    try:
        return pipeline_cut(model)
    except ValueError as err:
        raise ValueError(f"tensor parallelism finds the embedding, the final norm and the head by the pipeline "
                         f"plan: {err}") from None


def structural_cut(model) -> PipelineCut:
    """The cut read off the base model's own modules: its input embedding (get_input_embeddings), its one list of
    config.num_hidden_layers decoder layers, the modules with weights registered after that list (its final
    norm), and its head. ValueError where the base model does not show them so."""
    kind, prefix = type(model).__name__, model.base_model_prefix
    if getattr(model, prefix, None) is None:
        raise ValueError(f"{kind}'s config declares no base_model_pp_plan, and it holds no base model at its "
                         f"base_model_prefix ({prefix!r})")
    children = list(model.get_submodule(prefix).named_children())
    layers = [i for i, (_, m) in enumerate(children)
              if _is_list(m) and len(m) == getattr(model.config, "num_hidden_layers", None)]
    embedding = next((n for n, m in children if m is model.get_input_embeddings()), None)
    if len(layers) != 1 or embedding is None:
        raise ValueError(f"{kind}'s config declares no base_model_pp_plan, and its base model shows no input "
                         "embedding and one list of num_hidden_layers decoder layers beside it")
    after = [f"{prefix}.{n}" for n, m in children[layers[0] + 1:] if next(m.parameters(), None) is not None]
    return PipelineCut(before=(f"{prefix}.{embedding}",), blocks=f"{prefix}.{children[layers[0]][0]}",
                       after=(*after, head_name(model)), hidden_input="inputs_embeds")


def head_name(model) -> str:
    """The module name of the causal LM's output head (its get_output_embeddings())."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model.named_modules() if m is head), None) if head is not None else None
    if name is None:
        raise ValueError(f"{type(model).__name__} has no output head (get_output_embeddings)")
    return name


def _is_list(module) -> bool:
    return any(c.__name__ == "ModuleList" for c in type(module).__mro__)


# ---- the tensor-parallel rules ---------------------------------------------------------------------------

def plan_styles(model, notes: PlanNotes, replicated: tuple[str, ...] = ()) -> dict[str, str]:
    """Pattern (under the model) -> tessel style, from the config's base_model_tp_plan refined by `notes`; the
    keys that name only modules inside `replicated` ones, or no module of this model (an optional module its
    config leaves out), are left out. ValueError naming a style tessel does not map, or a note the plan lacks."""
    theirs = dict(getattr(model.config, "base_model_tp_plan", None) or {})
    theirs |= inherited_entries(model, theirs)  # what it says of the modules their classes derive from
    unknown = [key for key, _ in notes.linear if key not in theirs]
    if unknown:
        raise ValueError(f"the family's notes refine {unknown}, which {type(model).__name__}'s base_model_tp_plan "
                         "does not name")
    prefix, out = model.base_model_prefix, {}
    names = [n for n, _ in model.named_modules()]
    for key, style in {**theirs, **dict(notes.linear)}.items():
        pattern = f"{prefix}.{key}"
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if all(_named(n, replicated) for n in matched):
            continue  # inside modules every tp rank computes whole, or absent from this model
        if any(_named(n, replicated) for n in matched):
            raise ValueError(f"transformers' tensor-parallel plan entry '{pattern}' names modules both inside and "
                             f"outside the MoE blocks tessel computes whole on every tp rank ({', '.join(replicated)})")
        if key in dict(notes.linear):
            out[pattern] = style  # already tessel's
        elif style in HF_STYLES:
            out[pattern] = HF_STYLES[style]
        else:
            raise ValueError(f"transformers' tensor-parallel plan asks {style!r} of '{pattern}', which tessel "
                             f"does not map (it maps {', '.join(sorted(HF_STYLES))})")
    return out


def moe_blocks(model, blocks: str) -> tuple[str, ...]:
    """The MoE blocks of the model: the modules around those its tensor- or expert-parallel plan styles as a
    whole module of experts (EXPERTS), by name; every tp rank computes them whole, their experts go to ep.
    ValueError where the experts sit in a decoder layer itself (no block around them to compute whole)."""
    config, prefix = model.config, model.base_model_prefix
    keys = [k for plan in (getattr(config, "base_model_tp_plan", None), getattr(config, "base_model_ep_plan", None))
            for k, style in (plan or {}).items() if style in EXPERTS]
    found = {}
    for name, _ in model.named_modules():
        if any(fnmatch.fnmatchcase(name, f"{prefix}.{k}") for k in keys):
            parent = name.rpartition(".")[0]
            if parent.rpartition(".")[0] == blocks:
                raise ValueError(f"tensor parallelism cannot place the experts '{name}': they sit in the decoder "
                                 "layer itself, with no MoE block around them that every tp rank could compute whole")
            found[parent] = None
    return tuple(found)


def rules_from_plan(model, cut: PipelineCut, notes: PlanNotes) -> TPRules:
    """A family's rules from its base_model_tp_plan, its pipeline cut (embedding, layers, final norm, head) and
    the modules of its decoder layers; ValueError naming the first module neither the plan nor the model's
    structure places."""
    prefix = _with_tp_plan(model).base_model_prefix
    replicated = moe_blocks(model, cut.blocks)
    linear = plan_styles(model, notes, replicated)
    _check_linear(model, linear)
    norms, kept, summed = _layer_modules(model, cut.blocks, linear, replicated)
    linear |= summed
    final = cut.after[:-1]  # the head is last
    if len(final) != 1:
        raise ValueError(f"{type(model).__name__} has {list(final)} between its layers and its head (the parts of "
                         "its pipeline plan, or its modules with weights); tensor parallelism expects one final norm")
    rules = TPRules(embedding=cut.before[0], first_layer=f"{cut.blocks}.0", norms=norms, final_norm=final[0],
                    head=cut.after[-1], linear=tuple(linear.items()), replicated=replicated, kept=kept,
                    widths=tuple((f"{prefix}.{k}", v) for k, v in notes.widths),
                    blocks=tuple((f"{prefix}.{k}", _sizes(model, v)) for k, v in notes.blocks))
    _check_outside_layers(model, rules, cut.blocks)
    return rules


def _with_tp_plan(model):
    """The model, if its config declares a tensor-parallel plan; ValueError saying it does not."""
    if not getattr(model.config, "base_model_tp_plan", None):
        raise ValueError(f"{type(model).__name__}'s config declares no base_model_tp_plan (transformers' "
                         "tensor-parallel plan)")
    return model


def _check_linear(model, linear: dict[str, str]) -> None:
    """Each module the plan splits by rows or columns is a linear layer (by class name): ValueError naming one
    that is not (a fused parameter of experts, a norm asked for a column split)."""
    for name, module in model.named_modules():
        style = next((s for p, s in linear.items() if fnmatch.fnmatchcase(name, p)), None)
        if style is not None and style != "sum_grads" and not _is_linear(module):
            raise ValueError(f"tensor parallelism cannot place '{name}' ({type(module).__name__}): transformers' "
                             f"tensor-parallel plan asks a {style} split of it, and it is not a linear layer")


def _check_outside_layers(model, rules: TPRules, blocks: str) -> None:
    """Outside the decoder layers, a module with weights must be the embedding, the final norm or the head (or
    lie in one): ValueError naming the first that is none of them."""
    placed = (rules.embedding, blocks, rules.final_norm, rules.head, *rules.kept)
    for name, module in model.named_modules():
        if _has_weights(module) and not _named(name, placed):
            raise ValueError(f"tensor parallelism cannot place '{name}' ({type(module).__name__}): the pipeline "
                             "plan's embedding, layers, final norm and head do not hold it")


def _layer_modules(model, blocks: str, linear: dict[str, str],
                   replicated: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], dict[str, str]]:
    """(norms, kept, summed): patterns of the modules with weights in the decoder layers that the plan does not
    name. Outside the regions of column-parallel layers, a norm (it runs on sequence shards under sequence
    parallelism); inside a region whose column layers gather their outputs, a module every rank computes on
    the same whole tensor (kept whole); inside any region, a module whose weights are scalars (Apertus' xIELU
    activation: elementwise, the same on every rank's columns), or one the region's forward runs before any split
    (latent attention's q_a_proj and its norms: _before_the_split), whose gradients each rank has a part of
    ("sum_grads", as transformers' replicated_with_grad_allreduce). Anything else is refused by name. A norm
    without weights outside every region (OLMo's LayerNorm) is listed with the norms: nothing to do in 1D, and a
    tp grid, whose residual stream is split by hidden chunks, runs it over the whole hidden dim."""
    regions: dict[str, list[str]] = {}
    for p, s in linear.items():
        if s in COLUMN:
            regions.setdefault(_parent(p), []).append(s)
    norms, kept, summed = {}, {}, {}
    for name, module in model.get_submodule(blocks).named_modules(prefix=blocks):
        if _named(name, (*linear, *replicated)):
            continue
        pattern = f"{blocks}.*.{name[len(blocks) + 1:].partition('.')[2]}"
        region = next((r for r in regions if _named(name, (r,))), None)
        if not _has_weights(module):  # a norm without weights (OLMo's LayerNorm) is a norm still: a tp grid, whose
            if region is None and _is_norm(module) and name != blocks:  # stream is split by hidden, runs it whole
                norms[pattern] = None
            continue
        if region is not None and fnmatch.fnmatchcase(name, region):  # the module around the projections itself
            own = ", ".join(n for n, _ in module.named_parameters(recurse=False))
            raise ValueError(f"tensor parallelism cannot place '{name}' ({type(module).__name__}): it holds weights "
                             f"of its own ({own}) beside the projections the plan splits, which the plan does "
                             "not name")
        if region is None and _is_norm(module):
            norms[pattern] = None
        elif region is not None and all(s in GATHERED for s in regions[region]):
            kept[pattern] = None
        elif region is not None and (all(p.numel() == 1 for p in module.parameters(recurse=False))
                                     or _before_the_split(model, name, region, linear)):
            summed[pattern] = "sum_grads"
        else:
            where = _outside(pattern, linear) if region is None else \
                f"inside {region}, whose projections the plan splits by heads, and the plan does not name it"
            raise ValueError(f"tensor parallelism cannot place '{name}' ({type(module).__name__}): {where}")
    return tuple(norms), tuple(kept), summed


def _before_the_split(model, name: str, region: str, linear: dict[str, str]) -> bool:
    """Whether the module `name` lies in a child of its region that the region's forward runs on whole values
    only, before any column-parallel layer splits them (tessel.hf.region_inputs: latent attention's low-rank
    down projections and their norms): every rank computes it whole, each holding its own heads' share of its
    gradients."""
    parts = name.split(".")
    at = next(i for i in range(1, len(parts)) if fnmatch.fnmatchcase(".".join(parts[:i]), region))
    if at >= len(parts):
        return False  # the region module itself
    children = {p.rpartition(".")[2]: s for p, s in linear.items() if _parent(p) == region}
    split = frozenset(c for c, s in children.items() if s in COLUMN)
    rows = frozenset(c for c, s in children.items() if s.startswith("rowwise"))
    return parts[at] in before_split(model.get_submodule(".".join(parts[:at])), split, rows)


def _outside(pattern: str, linear: dict[str, str]) -> str:
    """Why a module of a decoder layer outside every region is not placed: the plan names nothing in it or in the
    module holding it (an attention it leaves whole, which tessel does not compute on every rank unasked), or it
    is not a norm."""
    layer = pattern.split(".*.")[0] + ".*"
    for scope in (_parent(pattern), pattern):  # the module holding it, or itself (one with weights of its own)
        if len(scope) > len(layer) + 1 and not any(p.startswith(scope + ".") for p in linear):
            return f"outside the attention and the MLP: base_model_tp_plan names no module of {scope}"
    return "outside the attention and the MLP, and not a norm"


def _named(name: str, patterns) -> bool:
    """Whether a pattern names the module or one above it."""
    parts = name.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), p) for p in patterns for i in range(1, len(parts) + 1))


def _has_weights(module) -> bool:
    return next(module.parameters(recurse=False), None) is not None


def _is_norm(module) -> bool:
    """A per-token norm: its class says so and its weights are per channel (1-D)."""
    return "Norm" in type(module).__name__ and all(p.dim() == 1 for p in module.parameters(recurse=False))


def _is_linear(module) -> bool:
    return any(c.__name__ in LINEAR_CLASSES for c in type(module).__mro__)


def _sizes(model, sizes: tuple[int | str, ...]) -> tuple[int, ...]:
    return tuple(s if isinstance(s, int) else int(getattr(model.config, s)) for s in sizes)


def _parent(pattern: str) -> str:
    return pattern.rpartition(".")[0]


# ---- before any process starts -----------------------------------------------------------------------------

def tp_problem(doc: dict) -> str | None:
    """Why the plans of the model a config.json (`doc`) builds do not place it under tensor parallelism, or
    None: the derivation the ranks run (rules_from_plan), on the model built on the meta device."""
    return _problems(json.dumps(doc, sort_keys=True))[0]


def pp_problem(doc: dict) -> str | None:
    """Why the model's pipeline plan does not cut it into stages (pipeline_cut), or None."""
    return _problems(json.dumps(doc, sort_keys=True))[1]


@functools.lru_cache(maxsize=32)
def _problems(doc_json: str) -> tuple[str | None, str | None]:
    try:
        model = cached_meta_model(doc_json)
    except Exception as err:  # whatever the family's class raises on this config is the answer, on one line
        why = f"transformers does not build its model from this config ({type(err).__name__}: " \
              f"{' '.join(str(err).split())})"
        return why, why
    return _reason(lambda: rules_from_plan(model, tp_cut(_with_tp_plan(model)), PlanNotes())), \
        _reason(lambda: pipeline_cut(model))


def _reason(derive) -> str | None:
    try:
        derive()
    except ValueError as err:
        return str(err)
    return None


@functools.lru_cache(maxsize=8)
def cached_meta_model(doc_json: str):
    """meta_model of a config.json's sorted JSON text, built once for every check that reads it (tp, pp, ep)."""
    return meta_model(json.loads(doc_json))


def meta_model(doc: dict):
    """transformers' causal LM for the config, its parameters on the meta device (no memory, no initialization),
    built in the context from_pretrained builds it in (get_init_context)."""
    # deferred: transformers loads torch (seconds); only a recipe naming a Hugging Face model asks
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING
    from transformers.utils.generic import ContextManagers
    import torch  # deferred: transformers' init context takes a torch dtype, the default one training uses
    config = transformers_config(doc)
    model_class = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    with ContextManagers(model_class.get_init_context(torch.get_default_dtype(), False, False, None)):
        return model_class(config)
