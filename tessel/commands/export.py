"""`tessel export CHECKPOINT --format hf --out DIR`: a checkpoint as a folder transformers loads.

A tessel checkpoint holds every model tensor as its logical whole whatever
layout saved it (tp, pp, ep, ZeRO shards), so an export reads it in one
process (tessel.train.checkpoint.read) and writes what
`AutoModelForCausalLM.from_pretrained(DIR)` reads: `config.json` and
`model.safetensors` (numbered shards and `model.safetensors.index.json` past
--shard-mb).

- A Hugging Face model keeps its own names; its config is the copy the
  checkpoint carries (tessel.train.checkpoint.manager.embed_hf_config), else
  the recipe's file, else --config. Tied weights are written once, as
  save_pretrained writes them.
- tessel's reference GPT becomes a LlamaForCausalLM (tessel.models.hf.convert:
  names mapped, q/k rows regrouped for rotate-half rotary, the norm eps and
  rope theta carried over).

Every input is checked before anything is read or written (`check_export`):
the checkpoint whole and untampered, its tensors' names and shapes against the
model its manifest names (built on the meta device), the output folder.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from tessel.config import ConfigError, ModelConfig
from tessel.hf.config import transformers_config
from tessel.hf.shape import HFConfigError, config_file, model_shape, read_config
from tessel.models.build import build_model, naming
from tessel.models.hf.convert import NotConvertible, gpt_to_llama, llama_config
from tessel.models.weights import WeightsError, match, write_weights
from tessel.train.checkpoint.manager import list_checkpoints, verify
from tessel.train.checkpoint.manifest import MANIFEST, CheckpointError
from tessel.train.checkpoint.read import MODEL_PREFIX, embedded_hf_config, read_model_tensors
from tessel.train.checkpoint.safe_dcp import read_metadata

FORMATS = ("hf",)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SHAPE_KEYS = ("vocab_size", "n_layer", "n_head", "n_kv_head", "d_model", "d_ff", "tie_embeddings")


@dataclass
class ExportJob:
    """What check_export found: the checkpoint, the model it holds, where its config comes from."""
    checkpoint: Path
    out: Path
    model: ModelConfig
    source: dict[str, str]  # the exported name -> the checkpoint's name it is read from
    dtype: torch.dtype | None  # None: as saved
    shard_bytes: int
    overwrite: bool


def check_export(checkpoint: str, fmt: str, out: str, config: str | None = None, dtype: str | None = None,
                 shard_mb: float = 5000.0, overwrite: bool = False) -> ExportJob:
    """Every argument of `tessel export`, checked before any tensor is read; ConfigError naming it."""
    if fmt not in FORMATS:
        raise ConfigError("--format", f"'{fmt}' is not a format tessel exports; choose one of {list(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError("--dtype", f"'{dtype}' is not one of {list(DTYPES)}")
    if not shard_mb > 0:
        raise ConfigError("--shard-mb", f"must be more than 0 (got {shard_mb})")
    path = checked_checkpoint(checkpoint)
    manifest = _verified(path)
    model = checkpoint_model(path, manifest["model"], config)
    source = exported_names(path, model)
    check_out(Path(out), overwrite)
    return ExportJob(path, Path(out), model, source, DTYPES.get(dtype), int(shard_mb * 2**20), overwrite)


def checked_checkpoint(checkpoint: str) -> Path:
    path = Path(checkpoint)
    if not path.exists():
        raise ConfigError("CHECKPOINT", f"no such folder: {path}")
    if not path.is_dir():
        raise ConfigError("CHECKPOINT", f"{path} is a file; a checkpoint is a folder step_N holding {MANIFEST}")
    inside = list_checkpoints(path)
    if inside and not (path / MANIFEST).exists():
        raise ConfigError("CHECKPOINT", f"{path} is a folder of checkpoints; name one of them, e.g. {inside[0]}")
    return path


def _verified(path: Path) -> dict:
    try:
        return verify(path)
    except CheckpointError as err:
        raise ConfigError("CHECKPOINT", str(err)) from None


def checkpoint_model(path: Path, saved: dict, config: str | None) -> ModelConfig:
    """The model config a checkpoint's manifest names; a Hugging Face model's config file is --config,
    else the copy the checkpoint carries, else the path the recipe named (which must still hold it)."""
    saved = {k: v for k, v in saved.items() if k != "init_from"}  # the weights it started from: not needed
    if saved.get("hf_config") is None:
        if config is not None:
            raise ConfigError("--config", "applies to checkpoints of Hugging Face models; this one holds "
                              "tessel's reference GPT (exported as a Llama)")
        try:
            return ModelConfig.model_validate(saved)
        except ValueError as err:
            raise ConfigError("CHECKPOINT", f"{path}: its manifest's model is not a tessel model ({err})") from None
    file = _hf_config_file(path, saved["hf_config"], config)
    try:
        shape = model_shape(file)
    except HFConfigError as err:
        raise ConfigError("--config" if config else "CHECKPOINT", str(err)) from None
    differs = [f"{k} {shape.get(k)} (the checkpoint's: {saved.get(k)})" for k in SHAPE_KEYS
               if k in shape and shape[k] != saved.get(k)]
    if differs:
        raise ConfigError("--config" if config else "CHECKPOINT",
                          f"{file} describes another model than the checkpoint holds: {', '.join(differs)}")
    return ModelConfig.model_validate({**{k: v for k, v in saved.items() if k not in shape}, "hf_config": str(file)})


def _hf_config_file(path: Path, recipe_path: str, config: str | None) -> Path:
    if config is not None:
        if not config_file(config).is_file():
            raise ConfigError("--config", f"no such file: {config_file(config)}")
        return config_file(config)
    carried = embedded_hf_config(path)
    if carried is not None:
        return carried
    if config_file(recipe_path).is_file():
        return config_file(recipe_path)
    raise ConfigError("--config", f"{path} carries no config.json and its recipe's {recipe_path} is gone: "
                      "pass the model's config.json with --config")


def exported_names(path: Path, model: ModelConfig) -> dict[str, str]:
    """The name each exported tensor has in the checkpoint (tied tensors once), checked against the model
    the manifest names, built on the meta device: ConfigError naming what is missing or misshapen."""
    saved = {fqn[len(MODEL_PREFIX):]: tuple(e.size) for fqn, e in read_metadata(path).state_dict_metadata.items()
             if fqn.startswith(MODEL_PREFIX)}
    try:
        if model.hf_config is None:
            llama_config(model)  # a GPT that has no Llama counterpart is refused here
    except NotConvertible as err:
        raise ConfigError("CHECKPOINT", f"{path}: {err}") from None
    with torch.device("meta"):
        module = build_model(model)
    try:
        return match(module, saved, naming(module, model))
    except WeightsError as err:
        raise ConfigError("CHECKPOINT", f"{path}: its tensors do not fit its model: {err}") from None


def check_out(out: Path, overwrite: bool) -> None:
    """An output folder that is new, empty, or (--overwrite) replaceable, inside a folder we can write in."""
    if out.exists() and not out.is_dir():
        raise ConfigError("--out", f"{out} is a file; give a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise ConfigError("--out", f"{out} is not empty (pass --overwrite to replace it)")
    parent = next(p for p in out.absolute().parents if p.exists())
    if not parent.is_dir():
        raise ConfigError("--out", f"cannot write {out}: {parent} is not a folder")
    try:
        tempfile.TemporaryFile(dir=parent).close()
    except OSError as err:
        raise ConfigError("--out", f"cannot write {out}: nothing can be created in {parent} ({err.strerror})") from None


# ---- the export ------------------------------------------------------------------------------
def export_hf(job: ExportJob) -> Path:
    """Write job.out (config.json + safetensors) from job.checkpoint; the folder appears whole or not at all."""
    saved = read_model_tensors(job.checkpoint, check=False)  # check_export verified it
    tensors = {name: saved[src] for name, src in job.source.items()}
    if job.model.hf_config is None:
        tensors, config = gpt_to_llama(tensors, job.model), _llama_config(job.model)
    else:
        config = _hf_config(job.model)
    if job.dtype is not None:
        tensors = {k: v.to(job.dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    config.dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    job.out.absolute().parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{job.out.name}.tmp-", dir=job.out.absolute().parent))
    try:
        write_weights(tmp, tensors, job.shard_bytes)
        config.save_pretrained(tmp)
        _readable(tmp)
        if job.out.exists():
            shutil.rmtree(job.out)
        os.replace(tmp, job.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return job.out


def _readable(folder: Path) -> None:
    """The modes a plain mkdir and open would have given (mkdtemp and safetensors make them private)."""
    umask = os.umask(0)
    os.umask(umask)
    folder.chmod(0o777 & ~umask)
    for f in folder.iterdir():
        f.chmod(0o666 & ~umask)


def _llama_config(model: ModelConfig):
    from transformers import LlamaConfig  # deferred: transformers loads in seconds
    # the GPT has no special tokens of its own: Llama's default bos/eos ids would name arbitrary tokens
    return LlamaConfig(**llama_config(model), bos_token_id=None, eos_token_id=None)


def _hf_config(model: ModelConfig):
    with torch.device("meta"):
        architecture = type(build_model(model)).__name__
    doc = read_config(model.hf_config)
    config = transformers_config(doc)
    config.architectures = [architecture]
    return config
