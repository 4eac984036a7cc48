"""What a checkpoint's manifest.json must hold, checked before anything in it is used.

A manifest that is valid JSON can still be the wrong shape (a file entry
without its checksum, `files` a string, no `step`); reading such a one with
plain dict access fails with a KeyError deep in the resume path, and `--resume
auto` never reaches the older checkpoint that would have worked. Here it is
validated against a pydantic schema first, and every problem becomes a
CheckpointError with a one-line reason.

Two levels: every tessel checkpoint has the fields of `Manifest`; one that a
trainer resumes from also has the training state of `TrainingManifest`
(written by tessel.train.fault.guard.run_info).
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

FORMAT = "tessel-checkpoint-1"
MANIFEST = "manifest.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message says why, in one line."""


class _Schema(BaseModel):
    # JSON has real types: "2" is not a step; unknown keys are kept (a newer writer may add some)
    model_config = ConfigDict(strict=True, extra="allow")


class FileEntry(_Schema):
    bytes: int = Field(ge=0)
    sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]


class Manifest(_Schema):
    format: Literal["tessel-checkpoint-1"]
    step: int = Field(ge=0)
    model: dict[str, Any]
    files: dict[str, FileEntry]
    run_id: str | None = None
    created: float | None = None


class Layout(_Schema):
    dp: int = Field(ge=1)
    tp: int = Field(ge=1)
    pp: int = Field(ge=1)
    grad_accum: int = Field(ge=1)


class TrainingManifest(Manifest):
    world_size: int = Field(ge=1)
    layout: Layout
    global_batch: int = Field(ge=1)
    sampler: dict[str, Any]
    scheduler: dict[str, Any]
    param_groups: list[dict[str, Any]]
    ps_updates: int | None = Field(None, ge=0)
    ps_mode: str | None = None


def _first_error(err: ValidationError) -> str:
    """'files/__0_0.distcp/sha256: Field required (+1 more)': pydantic's report in one line."""
    errors = err.errors()
    first = errors[0]
    where = "/".join(str(p) for p in first["loc"]) or "the document"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{where}: {first['msg']}{more}"


def parse_manifest(doc: object, training: bool = False) -> dict:
    """`doc` if it has the shape of a manifest (with the training state when `training`); else ValueError."""
    schema = TrainingManifest if training else Manifest
    try:
        schema.model_validate(doc)
    except ValidationError as err:
        raise ValueError(_first_error(err)) from None
    return doc


def regular_file(folder: Path, name: str) -> Path:
    """folder/name, which must be a regular file directly inside folder: not a symlink, not in a subfolder."""
    if not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"{folder}: {name!r} is not a plain file name (it would leave the checkpoint)")
    path = Path(folder) / name
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{folder}: file {name} is missing") from None
    if stat.S_ISLNK(mode):
        raise CheckpointError(f"{folder}: {name} is a symlink; a checkpoint holds its own files only")
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{folder}: {name} is not a regular file")
    return path


def read_manifest(path: Path, training: bool = False) -> dict:
    """The checkpoint's manifest, checked for shape; CheckpointError with a one-line reason otherwise."""
    path = Path(path)
    if not os.path.lexists(path / MANIFEST):
        raise CheckpointError(f"{path}: no {MANIFEST} (an interrupted save?)")
    try:
        doc = json.loads(regular_file(path, MANIFEST).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path}: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} manifest")
    try:
        return parse_manifest(doc, training)
    except ValueError as err:
        raise CheckpointError(f"{path}: malformed {MANIFEST}: {err}") from None


def run_of(path: Path) -> str | None:
    """The run id a checkpoint's manifest names, read without checking anything else (None if unreadable)."""
    try:
        doc = json.loads((Path(path) / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    run = doc.get("run_id") if isinstance(doc, dict) else None
    return run if isinstance(run, str) else None


def run_model(cfg) -> dict:
    """The model config as a manifest holds it (JSON values)."""
    return cfg.model.model_dump(mode="json")


def check_model(path: Path, manifest: dict, model: dict | None) -> None:
    """CheckpointError unless the checkpoint holds `model` (None: any model). A field the checkpoint does not
    name is null there: a field added to the model's config later, whose default (null) keeps the model as it
    was, leaves older checkpoints loadable."""
    if model is None:
        return
    saved = manifest["model"]
    diff = [f"{k} {saved.get(k, '(unset)')} (this run: {model.get(k, '(unset)')})"
            for k in sorted(set(saved) | set(model)) if saved.get(k) != model.get(k)]
    if not diff:
        return
    raise CheckpointError(f"{path}: holds another model: {', '.join(diff[:4])}{', ...' if len(diff) > 4 else ''}")


def check_owner(path: Path, manifest: dict, run_id: str | None) -> None:
    """CheckpointError unless the checkpoint was written by run `run_id` (None: any run)."""
    if run_id is not None and manifest.get("run_id") != run_id:
        raise CheckpointError(f"{path}: belongs to run {manifest.get('run_id') or '(unnamed)'}, not to this "
                              f"run ({run_id})")
