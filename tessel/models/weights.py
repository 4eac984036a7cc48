"""Weights in and out as safetensors, under the model's own parameter names.

A weights path is a `.safetensors` file or a folder of them: sharded, with
`model.safetensors.index.json` naming the file of every tensor (as
transformers' `save_pretrained` writes it), or not (every `*.safetensors` in
the folder). Nothing here unpickles: safetensors holds raw tensors and a JSON
header, which `stored_shapes` reads without touching the payload.

What a model expects is its persistent state dict, each tensor once: tied
weights (an output head that is the embedding) appear under their first name,
and a file may hold either name of a tied group, or both with equal values.
Non-persistent buffers (rotary tables) are rebuilt from the config and never
read. Every missing or unexpected name and every wrong shape is an error that
names them, raised before a single value is copied; `check_against` runs the
same check on a model built on the meta device, so a launcher can refuse bad
weights before any process starts.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size for save_pretrained


class WeightsError(ValueError):
    """Weights that do not fit a model, or files that are not weights; the message says which, in one line."""


@dataclass(frozen=True)
class Naming:
    """How a file's names may differ from the model's own, as transformers' from_pretrained allows.

    prefix: the base model's attribute (GPT-2's `transformer`): a file saved from the base model alone
    names `h.0.attn...` for the head model's `transformer.h.0.attn...`. ignore: patterns of names a file
    may hold that the model does not (GPT-2's old causal-mask buffers `attn.bias`)."""
    prefix: str = ""
    ignore: tuple[str, ...] = field(default_factory=tuple)


# ---- files ----------------------------------------------------------------------------------
def weight_files(path: str | Path) -> list[Path]:
    """The safetensors files of a weights path, in order; WeightsError when there are none."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise WeightsError(f"{path} is not a .safetensors file")
        return [path]
    if not path.is_dir():
        raise WeightsError(f"no such file or folder: {path}")
    index = path / INDEX
    if index.is_file():
        return _indexed_files(path, index)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightsError(f"{path} holds no .safetensors file")
    return files


def _indexed_files(folder: Path, index: Path) -> list[Path]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise WeightsError(f"{index} is not a safetensors index ({err!r})") from None
    files = []
    for name in names:
        if not isinstance(name, str) or Path(name).name != name:
            raise WeightsError(f"{index} names {name!r}, which is not a file in {folder}")
        if not (folder / name).is_file():
            raise WeightsError(f"{index} names {name}, which is missing from {folder}")
        files.append(folder / name)
    return files


def stored_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every tensor at a weights path, from the files' headers alone."""
    from safetensors import safe_open  # deferred: only runs that read weights need safetensors
    shapes: dict[str, tuple[int, ...]] = {}
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if name in shapes:
                        raise WeightsError(f"'{name}' is stored twice (again in {file.name})")
                    shapes[name] = tuple(f.get_slice(name).get_shape())
        except WeightsError:
            raise
        except Exception as err:  # safetensors raises its own SafetensorError for a bad header
            raise WeightsError(f"{file} is not a safetensors file ({err})") from None
    return shapes


def read_weights(path: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor at a weights path (the payload read with safetensors: no pickle)."""
    from safetensors.torch import load_file  # deferred: only runs that read weights need safetensors
    out: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        out.update(load_file(str(file)))
    return out


def write_weights(folder: str | Path, tensors: dict[str, torch.Tensor], shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """`tensors` as `model.safetensors`, or as numbered shards with an index when they exceed
    shard_bytes (the layout save_pretrained writes); the files written."""
    from safetensors.torch import save_file  # deferred: only exports write weights
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.contiguous()
        size += nbytes
    if len(shards) == 1:
        names = [SINGLE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, shard in zip(names, shards):
        save_file(shard, str(folder / name), metadata={"format": "pt"})
    if len(shards) > 1:
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        weight_map = {k: name for name, shard in zip(names, shards) for k in shard}
        (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                               indent=2))
    return [folder / n for n in names]


# ---- what a model expects ------------------------------------------------------------------------
def tied_names(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(first name -> tensor of every persistent tensor, other name -> first name for tied ones)."""
    canonical: dict[str, torch.Tensor] = {}
    first_of: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in first_of:
            aliases[name] = first_of[id(t)]
        else:
            first_of[id(t)] = name
            canonical[name] = t
    return canonical, aliases


def _renamed(stored: dict, model_names: set[str], naming: Naming) -> dict[str, str]:
    """Stored name -> the model's name for it (the base-model prefix added where the file lacks it);
    names the model may ignore are left out."""
    ignore = [re.compile(p) for p in naming.ignore]
    out = {}
    for name in stored:
        target = name
        if name not in model_names and naming.prefix and f"{naming.prefix}.{name}" in model_names:
            target = f"{naming.prefix}.{name}"
        if target not in model_names and any(p.search(name) for p in ignore):
            continue
        out[name] = target
    return out


def match(model: nn.Module, stored: dict[str, tuple[int, ...]], naming: Naming = Naming()) -> dict[str, str]:
    """The model's first name -> the stored name to read it from, for every tensor the model expects;
    WeightsError naming the missing, unexpected and misshapen tensors otherwise."""
    canonical, aliases = tied_names(model)
    targets = _renamed(stored, set(canonical) | set(aliases), naming)
    unexpected = sorted(n for n, t in targets.items() if t not in canonical and t not in aliases)
    source: dict[str, str] = {}
    for name, target in sorted(targets.items(), key=lambda kv: kv[1] in aliases):  # own names first
        if target in canonical or target in aliases:
            source.setdefault(aliases.get(target, target), name)
    missing = sorted(n for n in canonical if n not in source)
    wrong = [f"{n} {list(stored[s])} (the model's is {list(canonical[n].shape)})" for n, s in source.items()
             if tuple(stored[s]) != tuple(canonical[n].shape)]
    problems = []
    if missing:
        problems.append(f"missing {_few(missing)}")
    if unexpected:
        problems.append(f"unexpected {_few(unexpected)}")
    if wrong:
        problems.append(f"wrong shape: {_few(wrong)}")
    if problems:
        raise WeightsError("; ".join(problems))
    return source


def _few(names: list[str], n: int = 4) -> str:
    more = f" (+{len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def check_against(model: nn.Module, path: str | Path, naming: Naming = Naming()) -> None:
    """WeightsError unless the weights at `path` fit `model` (which may live on the meta device)."""
    match(model, stored_shapes(path), naming)


def load_weights(model: nn.Module, path: str | Path, naming: Naming = Naming()) -> None:
    """Copy the weights at `path` into `model` in place (cast to each tensor's dtype); tied tensors are
    written once. Everything is checked before the first copy."""
    source = match(model, stored_shapes(path), naming)
    canonical, aliases = tied_names(model)
    stored = read_weights(path)
    renamed = _renamed(stored, set(canonical) | set(aliases), naming)
    for name, target in renamed.items():  # a file that holds both names of a tied tensor: the same values
        first = aliases.get(target)
        if first is not None and source[first] != name and not torch.equal(stored[name], stored[source[first]]):
            raise WeightsError(f"the model ties {target} to {first}, but the file holds different values for them")
    with torch.no_grad():
        for name, src in source.items():
            canonical[name].copy_(stored[src])
