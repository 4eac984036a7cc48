"""Checkpoints with torch.distributed.checkpoint: atomic, checksummed, layout-independent, safe to load.

A checkpoint is a directory `step_000040/` holding
- DCP shard files (`*.distcp`): every tensor of the run as its logical,
  unsharded self (tessel.train.checkpoint.logical), so any layout can load it;
- `dcp_metadata.json`: DCP's index of those shards, as JSON (tessel.train.checkpoint.safe_dcp);
- `manifest.json`: step, the run that wrote it, layout, the plain-value
  training state (scheduler, data position, optimizer hyper-parameters) and
  the sha256 of every file (its schema: tessel.train.checkpoint.manifest).

It is written into `.tmp-step_000040/` by all ranks; rank 0 then writes the
manifest and renames the directory, so a checkpoint either exists whole or
not at all. A write that fails on a full disk removes its temporary directory
and stops the run on every rank with one line (DiskFullError).

`verify()` checks a checkpoint before anything in it is used: the manifest's
shape, the run and model it belongs to, every file (a regular file in the
folder, its size and checksum) and DCP's index (it reads only those files and
covers every tensor exactly). `latest_valid()` walks checkpoints newest first
and returns the first that passes, saying why it skipped the others; with a
run id it considers only that run's own, and pruning deletes only those.
Loading never unpickles: the manifest and metadata are JSON and the tensor
payloads are read with weights_only=True.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tessel.errors import FatalError
from tessel.hf.shape import config_file
from tessel.models.build import build_model
from tessel.observe.progress import Work, work_progress
from tessel.train.checkpoint.logical import LogicalView, check_shapes, module_shapes
from tessel.train.checkpoint.manifest import (FORMAT, MANIFEST, CheckpointError, check_model, check_owner,
                                              read_manifest, regular_file, run_model, run_of)
from tessel.train.checkpoint.safe_dcp import (METADATA_FILE, JsonMetadataWriter, SafeReader, UnsafeCheckpointError,
                                              check_coverage, disk_full_errno, read_metadata)
from tessel.train.checkpoint.tensors import StateTensors

PREFIX = "step_"
HF_CONFIG = "hf_config.json"  # a Hugging Face model's config, as the run read it (embed_hf_config)


class DiskFullError(FatalError):
    """A checkpoint write ran out of space (ENOSPC) or quota (EDQUOT); a restart would only repeat it."""


def step_dir(root: Path, step: int) -> Path:
    return Path(root) / f"{PREFIX}{step:08d}"


def tmp_dir(root: Path, step: int) -> Path:
    """Where step's files are written before the commit renames the directory to step_dir."""
    return Path(root) / f".tmp-{PREFIX}{step:08d}"


def fresh_dir(tmp: Path) -> None:
    """Create tmp empty (and its parent); a leftover of a save that died half-way is removed."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()


def sha256_file(path: Path, work: Work | None = None) -> str:
    """The file's sha256; `work` (a progress bar) hears of every MiB read."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if work is not None:
                work.advance(len(block))
    return h.hexdigest()


def checksum_bar(folder: Path, what: str, names: list[str] | None = None):
    """A bar over the bytes of the folder's files (all, or `names`) on a terminal; quiet in a log."""
    files = [folder / n for n in names] if names is not None else [f for f in folder.iterdir() if f.is_file()]
    total = sum(f.stat().st_size for f in files if f.is_file())
    return work_progress(f"{what} {folder.name}", total, in_bytes=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_manifest(tmp: Path, manifest: dict) -> None:
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


def refuse_others(final: Path, run_id: str | None) -> None:
    """CheckpointError if `final` holds another run's checkpoint: a run never replaces it (the same run
    saving a step again after a rollback does). Without a run id nothing is refused."""
    owner = run_of(final) if run_id is not None and final.exists() else None
    if owner is not None and owner != run_id:
        raise CheckpointError(f"{final} belongs to run {owner}; run {run_id} will not replace it "
                              "(give this run its own checkpoint.dir)")


def embed_hf_config(tmp: Path, model: dict | None) -> None:
    """A Hugging Face model's config.json travels inside each checkpoint (HF_CONFIG), checksummed with
    the rest: `tessel export` needs it after the recipe's copy has moved or changed."""
    path = (model or {}).get("hf_config")
    if path and config_file(path).is_file():
        shutil.copyfile(config_file(path), tmp / HF_CONFIG)


def commit(tmp: Path, final: Path, step: int, info: dict, run_id: str | None = None) -> None:
    """Checksum every file, write the manifest (owned by `run_id`), rename tmp -> final (rank 0 only)."""
    refuse_others(final, run_id)
    embed_hf_config(tmp, info.get("model"))
    files = {}
    with checksum_bar(tmp, "checksumming") as work:  # a large state's files take a while to hash
        for f in sorted(tmp.iterdir()):
            if f.is_file():
                files[f.name] = {"sha256": sha256_file(f, work), "bytes": f.stat().st_size}
    write_manifest(tmp, {"format": FORMAT, "step": step, "created": time.time(), **info, "run_id": run_id,
                         "files": files})
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a rollback
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


# ---- verification --------------------------------------------------------------
def verify(path: Path, model: dict | None = None, run_id: str | None = None) -> dict:
    """The manifest of a checkpoint that is whole, untampered and fit to resume, checked cheapest first:
    - manifest.json has the schema (and the training state when `model` is given: a trainer resumes);
    - it was written by run `run_id` (None: by any run) and holds `model` (None: any model);
    - every file it lists is a regular file directly in the folder, with its size and sha256;
    - DCP's metadata reads from those files only and covers every tensor exactly.
    CheckpointError with a one-line reason otherwise."""
    path = Path(path)
    manifest = read_manifest(path, training=model is not None)
    check_owner(path, manifest, run_id)
    check_model(path, manifest, model)
    _check_files(path, manifest["files"])
    _check_metadata(path, manifest["files"])
    return manifest


def _check_files(path: Path, files: dict) -> None:
    if METADATA_FILE not in files:
        raise CheckpointError(f"{path}: the manifest lists no {METADATA_FILE}")
    for name, want in files.items():
        f = regular_file(path, name)
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path}: {name} has {size} bytes, the manifest says {want['bytes']} "
                                  "(truncated or overwritten)")
    with checksum_bar(path, "verifying", list(files)) as work:
        for name, want in files.items():
            got = sha256_file(path / name, work)
            if got != want["sha256"]:
                raise CheckpointError(f"{path}: {name} fails its checksum (sha256 {got[:12]}..., "
                                      f"manifest {want['sha256'][:12]}...): the file is corrupt")


def _check_metadata(path: Path, files: dict) -> None:
    """DCP's index: well formed, every tensor covered exactly, read only from the manifest's files."""
    try:
        md = read_metadata(path)
        check_coverage(md)
    except (UnsafeCheckpointError, ValueError) as err:
        raise CheckpointError(f"{path}: {METADATA_FILE}: {err}") from None
    for idx, info in md.storage_data.items():
        name = info.relative_path
        if name not in files:
            raise CheckpointError(f"{path}: {METADATA_FILE} reads '{idx.fqn}' from {name!r}, a file the "
                                  "manifest does not list")
        if info.offset < 0 or info.length < 0 or info.offset + info.length > files[name]["bytes"]:
            raise CheckpointError(f"{path}: {METADATA_FILE} reads '{idx.fqn}' from bytes {info.offset}.."
                                  f"{info.offset + info.length} of {name}, which has {files[name]['bytes']}")


def check_resume_target(path: Path, cfg) -> dict:
    """An explicit `--resume PATH`, checked before any process exists: a checkpoint (not a folder of
    them), whole and untampered (verify), of cfg's model, whose tensors and optimizer states have the
    shapes of the model cfg builds. Its manifest; CheckpointError with a one-line reason otherwise."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; a checkpoint is a folder {PREFIX}N holding {MANIFEST}")
    inside = list_checkpoints(path)
    if inside and not (path / MANIFEST).exists():
        raise CheckpointError(f"{path} is a folder of checkpoints ({inside[0].name}"
                              f"{', ...' if len(inside) > 1 else ''}), not a checkpoint: pass --resume auto "
                              f"(the newest valid one in checkpoint.dir) or --resume {inside[0]}")
    manifest = verify(path, model=run_model(cfg))
    with torch.device("meta"):  # names and shapes only
        model_shapes, param_shapes = module_shapes(build_model(cfg.model))
    try:
        check_shapes(read_metadata(path).state_dict_metadata, model_shapes, param_shapes)
    except CheckpointError as err:
        raise CheckpointError(f"{path}: {err}") from None
    return manifest


# ---- choosing, pruning ------------------------------------------------------------
def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[len(PREFIX):]), reverse=True)


def own_checkpoints(root: Path, run_id: str | None) -> list[Path]:
    """Run `run_id`'s committed checkpoints (all of them when None), newest first; files are not checked."""
    return [d for d in list_checkpoints(root) if run_id is None or run_of(d) == run_id]


def prune(root: Path, keep: int, run_id: str | None = None) -> None:
    """Delete all but the `keep` newest checkpoints of run `run_id` (None: of any run); another run's
    checkpoints in the same folder are neither counted nor deleted."""
    for old in own_checkpoints(root, run_id)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def newest_run_id(root: Path) -> str | None:
    """The run id in the newest checkpoint under root whose manifest has the schema (no file is hashed):
    whose checkpoints a folder without run.json holds."""
    for d in list_checkpoints(root):
        try:
            manifest = read_manifest(d)
        except CheckpointError:
            continue
        return manifest.get("run_id")
    return None


def choose(root: Path, resume: str, log=print, model: dict | None = None, run_id: str | None = None) -> Path | None:
    """checkpoint.resume: 'auto' -> the newest of run `run_id`'s checkpoints under root that verifies
    (or None); a path -> that checkpoint, of any run, which must verify (no silent fallback).
    `model`: the run's model config (see verify)."""
    if resume == "auto":
        found = latest_valid(root, log, model, run_id)
        return None if found is None else found[0]
    verify(Path(resume), model)
    return Path(resume)


def latest_valid(root: Path, log=print, model: dict | None = None,
                 run_id: str | None = None) -> tuple[Path, dict] | None:
    """Newest checkpoint that verifies (for `model` and run `run_id`, see verify); each one skipped
    is reported with its reason."""
    for d in list_checkpoints(root):
        try:
            return d, verify(d, model, run_id)
        except CheckpointError as err:
            log(f"[tessel checkpoint] skipping {err}; falling back to the previous one")
    return None


def disk_full_error(err: BaseException, tmp: Path, root: Path, run_id: str | None) -> DiskFullError | None:
    """For a checkpoint write that failed on a full disk: remove its temporary folder (it holds the space
    the next attempt needs) and say so in one line; None for any other failure."""
    code = disk_full_errno(err)
    if code is None:
        return None
    shutil.rmtree(tmp, ignore_errors=True)
    previous = next(iter(own_checkpoints(root, run_id)), None)
    kept = f"the previous checkpoint {previous} is intact" if previous else "there is no earlier checkpoint"
    return DiskFullError(f"{os.strerror(code).lower()} ({errno.errorcode[code]}) writing checkpoint {tmp}; {kept}")


OK, FAILED, DISK_FULL = 0, 1, 2  # how rank 0's part of a save or a choice went (_on_rank0)


@dataclass
class Pending:
    future: object | None  # an async save's; None for a synchronous one
    tmp: Path
    final: Path
    step: int
    info: dict
    failure: BaseException | None = None  # how the write failed (CheckpointException), the same on every rank


class CheckpointManager:
    """Saves and loads the trainer's whole state (what a StateTensors hands over and takes back, plus
    the manifest's plain values); one per rank, all ranks call every method.

    run_id: written into every manifest; pruning and find('auto') then touch only this run's
    checkpoints (None: no owner, every checkpoint counts).
    alone: this rank saves and finds by itself, with no process group (a parameter server's worker 0
    writes what the servers hand it; each worker finds its resume point); writes=False: save() does
    nothing on this rank (a parameter server's other workers)."""

    def __init__(self, root: str | Path, mesh, keep: int = 3, async_save: bool = False, log=None,
                 run_id: str | None = None, alone: bool = False, writes: bool = True):
        self.root = Path(root)
        self.keep = keep
        self.async_save = async_save
        self.run_id = run_id
        self.writes = writes
        together = dist.is_initialized() and not alone
        self.rank = dist.get_rank() if together else 0  # the rank that decides (_on_rank0)
        self.view = LogicalView(mesh)
        speaks = not dist.is_initialized() or dist.get_rank() == 0
        self.speaks = speaks  # the one rank whose progress bars a terminal shows
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True) if speaks else None)
        # a group of its own (gloo: DCP's plans travel on CPU): an async save's collectives run in a
        # background thread and must not interleave with the training step's
        self.group = dist.new_group(backend="gloo") if together else None
        # the ranks agree that an async save is done on every rank over another group: the save's own
        # collectives may still be running on self.group
        self.poll_group = dist.new_group(backend="gloo") if together and async_save else None
        self.pending: Pending | None = None

    # ---- save -----------------------------------------------------------------
    def save(self, step: int, tensors: StateTensors, info: dict) -> None:
        """`tensors`' state after `step` steps as `step_<step>`; info: the manifest's plain values."""
        if not self.writes:
            return
        self.wait()
        final, tmp = step_dir(self.root, step), tmp_dir(self.root, step)
        self._on_rank0(lambda: self._prepare(tmp, final), tmp)
        state, about = tensors.save_tensors(self.view)
        info = {**info, **about}
        storage = dict(storage_writer=JsonMetadataWriter(tmp, sync_files=True), process_group=self.group,
                       no_dist=self.group is None)
        if self.async_save:
            self.pending = Pending(dcp.async_save(state, **storage), tmp, final, step, info)
            return
        self.pending = Pending(None, tmp, final, step, info)
        try:
            with self._bar(f"writing step {step}"):
                dcp.save(state, **storage)
        except CheckpointException as err:  # on every rank, once every rank is done writing
            self.pending.failure = err
        self._finish()

    def _bar(self, what: str):
        """A pulse while DCP writes or reads (it reports no progress of its own), on rank 0's terminal."""
        return work_progress(what) if self.speaks else nullcontext()

    def _prepare(self, tmp: Path, final: Path) -> str:
        refuse_others(final, self.run_id)  # before anything is written
        fresh_dir(tmp)
        return ""

    def poll(self) -> None:
        """Commit a finished async save (every rank calls it once per step; they commit at the same step)."""
        p = self.pending
        if p is not None and p.future is not None and self._done_everywhere(p.future.done()):
            self._finish()

    def wait(self) -> None:
        if self.pending is not None:
            self._finish()

    def _finish(self) -> None:
        p, self.pending = self.pending, None
        if p.future is not None:
            try:
                p.future.result()  # a failed background write: the same CheckpointException on every rank
            except CheckpointException as err:
                p.failure = err
        self._on_rank0(lambda: self._commit(p), p.tmp)

    def _commit(self, p: Pending) -> str:
        if p.failure is not None:
            raise p.failure
        # DCP returns after every rank's files and the metadata are written
        commit(p.tmp, p.final, p.step, p.info, self.run_id)
        prune(self.root, self.keep, self.run_id)
        self.log(f"[tessel checkpoint] saved step {p.step} -> {p.final}")
        return ""

    def _done_everywhere(self, done: bool) -> bool:
        # a rank whose write is done must not commit (a collective) while another rank trains on
        if self.poll_group is None:
            return done
        flag = torch.tensor([int(done)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.poll_group)
        return bool(flag.item())

    # ---- load -----------------------------------------------------------------
    def find(self, resume: str, model: dict | None = None) -> tuple[Path, dict] | None:
        """'auto' -> the newest of this run's checkpoints under root that verifies for `model` (or None);
        a path -> that checkpoint, verified (see choose)."""
        choice = self._on_rank0(lambda: str(choose(self.root, resume, self.log, model, self.run_id) or ""))
        return (Path(choice), manifest_of(choice)) if choice else None  # rank 0 verified it

    def load(self, path: Path, tensors: StateTensors) -> dict:
        """Load the checkpoint at `path` into this rank's (possibly different) layout; returns the manifest.
        CheckpointError, before anything is read, when a saved shape differs from this run's."""
        manifest = manifest_of(path)
        md = read_metadata(path)
        try:
            targets, put_back = tensors.load_targets(self.view, md.state_dict_metadata)
        except CheckpointError as err:
            raise CheckpointError(f"{path}: {err}") from None
        try:  # collective even where this rank has nothing to read (its planner still takes part)
            with self._bar(f"loading {path.name}"):
                dcp.load(targets, storage_reader=SafeReader(path), process_group=self.group,
                         no_dist=self.group is None)
        except CheckpointException as err:
            raise CheckpointError(f"{path}: could not be loaded: {_root_causes(err)}") from None
        for fqn, apply in put_back:
            apply(targets[fqn])
        tensors.after_load(path, md, manifest, self.view)
        return manifest

    # ---- rank 0 decides, every rank learns -----------------------------------------
    def _on_rank0(self, action: Callable[[], str], tmp: Path | None = None) -> str:
        """Run `action` on rank 0 alone; every rank returns the string it returned, or raises what went
        wrong there (so that no rank waits for a rank 0 that gave up): DiskFullError for a full disk,
        with the temporary folder `tmp` removed, else CheckpointError."""
        code, text, cause = OK, "", None
        if self.rank == 0:
            try:
                text = action()
            except (Exception, CheckpointException) as err:
                cause = err
                full = disk_full_error(err, tmp, self.root, self.run_id) if tmp is not None else None
                code, text = (DISK_FULL, str(full)) if full is not None else (FAILED, _one_line(err, tmp))
        code, text = self._from_rank0(code, text)
        if code == DISK_FULL:
            raise DiskFullError(text) from None
        if code == FAILED:
            if isinstance(cause, CheckpointError):
                raise cause
            raise CheckpointError(text) from cause
        return text

    def _from_rank0(self, code: int, text: str) -> tuple[int, str]:
        """Rank 0's (code, text) on every rank, as bytes in tensors (no pickling of objects)."""
        if self.group is None:
            return code, text
        raw = text.encode()
        head = torch.tensor([code, len(raw)], dtype=torch.long)
        dist.broadcast(head, src=0, group=self.group)
        n = int(head[1].item())
        if n == 0:
            return int(head[0].item()), ""
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if self.rank == 0 else torch.zeros(n, dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return int(head[0].item()), bytes(buf.tolist()).decode()


def _one_line(err: BaseException, tmp: Path | None) -> str:
    if isinstance(err, CheckpointException):
        return f"writing checkpoint {tmp} failed: {_root_causes(err)}"
    if isinstance(err, CheckpointError):
        return str(err)
    return f"{type(err).__name__}: {err}".replace("\n", " ")


def _root_causes(err: CheckpointException) -> str:
    """One line per failing rank: the underlying error (an unpickling refusal, a short read, ...)."""
    lines = []
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        text = str(exc).replace("\n", " ")
        unsafe = "Unsupported global" in text or "Weights only" in text
        lines.append(f"rank {rank}: {type(exc).__name__}: " +
                     ("refused to unpickle a non-tensor object (weights_only): " if unsafe else "") + text[:400])
    return "; ".join(lines)


def manifest_of(path: Path) -> dict:
    """A checkpoint's manifest, checked for shape only (verify() checks the files against it)."""
    return read_manifest(Path(path))


__all__ = ["CheckpointManager", "CheckpointError", "UnsafeCheckpointError", "DiskFullError", "disk_full_error",
           "verify", "check_resume_target", "latest_valid", "choose", "newest_run_id", "list_checkpoints",
           "own_checkpoints", "prune", "step_dir", "tmp_dir", "fresh_dir", "commit", "manifest_of", "run_model",
           "MANIFEST", "PREFIX"]
