"""A tessel checkpoint read back in one process, with no process group and no pickle.

Whatever layout saved it (dp, tp, pp, ep, ZeRO shards), a checkpoint holds
every model tensor as its logical whole under the full model's parameter name
(`model/<name>`; tessel.train.checkpoint.logical), so reading it needs neither
the layout nor the ranks: DCP plans the read from the JSON metadata
(tessel.train.checkpoint.safe_dcp) and copies each saved chunk into its place
in a whole tensor. This is what `tessel export` and a user's own script call:

    from tessel.train.checkpoint.read import read_model_tensors
    state = read_model_tensors("runs/x/checkpoints/step_00000100")  # name -> torch.Tensor
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tessel.train.checkpoint.manager import HF_CONFIG, verify
from tessel.train.checkpoint.manifest import CheckpointError
from tessel.train.checkpoint.safe_dcp import SafeReader, read_metadata

MODEL_PREFIX = "model/"


def read_model_tensors(path: str | Path, check: bool = True) -> dict[str, torch.Tensor]:
    """Name -> whole tensor of every model tensor in the checkpoint at `path` (the names the model
    itself uses; a tied weight appears under each of its names). check: verify the checkpoint first
    (manifest, every file's checksum, the metadata covering every tensor exactly)."""
    return read_tensors(path, MODEL_PREFIX, check)


def read_tensors(path: str | Path, prefix: str, check: bool = True) -> dict[str, torch.Tensor]:
    """read_model_tensors for the entries under any prefix: `optim/` gives the optimizer's state, whole,
    as `<parameter name>/<key>` (tessel.train.checkpoint.logical)."""
    path = Path(path)
    if check:
        verify(path)
    saved = read_metadata(path).state_dict_metadata
    targets = {fqn: torch.empty(entry.size, dtype=entry.properties.dtype)
               for fqn, entry in saved.items() if fqn.startswith(prefix)}
    if not targets:
        raise CheckpointError(f"{path}: holds no {prefix.rstrip('/')} tensors")
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(targets, storage_reader=SafeReader(path), no_dist=True)
    except CheckpointException as err:
        raise CheckpointError(f"{path}: could not be read: {err}") from None
    return {fqn[len(prefix):]: t for fqn, t in targets.items()}


def embedded_hf_config(path: str | Path) -> Path | None:
    """The Hugging Face config.json a checkpoint carries (tessel.train.checkpoint.manager.embed_hf_config)."""
    file = Path(path) / HF_CONFIG
    return file if file.is_file() else None
