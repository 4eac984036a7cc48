"""The tensor-parallel plan entries a module inherits from the family transformers derived its class from.

transformers writes most families as a modular file (models/<family>/modular_<family>.py) whose classes inherit
another family's: `class DeepseekV3Attention(DeepseekV2Attention)`, and YoutuAttention, AXK1Attention and
Glm4MoeLiteAttention inherit DeepSeek-V3's. Some families' base_model_tp_plan names no module of such a class
(DeepSeek-V3's names only its MLPs and experts) where the family it comes from splits it (DeepSeek-V2's plan:
q_proj, q_b_proj and kv_b_proj by heads, kv_a_proj_with_mqa whole, o_proj by rows). For a module its own
family's plan is silent on, tessel takes the entries of the nearest ancestor family's plan at the same place
(the same key under the base model), read from the modular source transformers ships. tessel.hf.layout then
checks them on this model's modules as it checks the model's own entries (a linear layer for every split,
every weight placed), and the parity sweep checks the forward that runs them.

Duck-typed like tessel.hf.layout: classes and their source, no torch import of its own.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
import importlib
import inspect
from pathlib import Path


def inherited_entries(model, plan: dict[str, str]) -> dict[str, str]:
    """Plan keys (under the base model) -> transformers' styles, for the modules of the base model that no key of
    `plan` names (nor anything inside them), from the plans of the families their classes derive from."""
    base = model.get_submodule(model.base_model_prefix)
    named = {n for n, _ in base.named_modules() if any(fnmatch.fnmatchcase(n, k) for k in plan)}
    covered = {".".join(n.split(".")[:i]) for n in named for i in range(1, n.count(".") + 2)}  # and above them
    out: dict[str, str] = {}
    for name, module in base.named_modules():
        if not name or name in covered:
            continue
        for ancestor_plan in _ancestor_plans(type(module)):
            found = {k: s for k, s in ancestor_plan.items() if fnmatch.fnmatchcase(name, k.rpartition(".")[0])}
            if found:
                out.update(found)
                break
    return out


@functools.cache
def _ancestor_plans(cls: type) -> tuple[dict[str, str], ...]:
    """The base_model_tp_plans of the families cls derives from, nearest first (its modular file's base class,
    then that class's, ...)."""
    plans, seen = [], {cls}
    while (parent := _modular_base(cls)) is not None and parent not in seen:
        seen.add(parent)
        plans += [dict(p) for p in _family_plans(parent)]
        cls = parent
    return tuple(plans)


def _modular_base(cls: type) -> type | None:
    """The class cls's modular file says it inherits from another family's module, or None."""
    try:
        source = Path(inspect.getsourcefile(cls))
    except (TypeError, OSError):
        return None
    modular = source.with_name(f"modular_{source.parent.name}.py")
    if not source.name.startswith("modeling_") or not modular.is_file():
        return None
    tree = ast.parse(modular.read_text())
    bases = [b.id for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__
             for b in node.bases if isinstance(b, ast.Name)]
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 2 and node.module:
            for alias in node.names:
                if alias.asname is None and alias.name in bases[:1]:
                    module = importlib.import_module(f"{cls.__module__.rsplit('.', 2)[0]}.{node.module}")
                    return getattr(module, alias.name, None)
    return None


def _family_plans(cls: type) -> list[dict[str, str]]:
    """The base_model_tp_plans of the configs of the models defined beside cls (its modeling file)."""
    module = importlib.import_module(cls.__module__)
    configs = {getattr(o, "config_class", None) for o in vars(module).values()
               if isinstance(o, type) and o.__module__ == module.__name__}
    return [c.base_model_tp_plan for c in configs if getattr(c, "base_model_tp_plan", None)]
