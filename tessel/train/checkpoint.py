"""Checkpoints with torch.distributed.checkpoint: atomic, checksummed, layout-independent, safe to load.

A checkpoint is a directory `step_000040/` holding
- DCP shard files (`*.distcp`): every tensor of the run as its logical,
  unsharded self (tessel.train.logical), so any layout can load it;
- `dcp_metadata.json`: DCP's index of those shards, as JSON (tessel.train.safe_dcp);
- `manifest.json`: step, layout, the plain-value training state (scheduler,
  data position, optimizer hyper-parameters) and the sha256 of every file.

It is written into `.tmp-step_000040/` by all ranks; rank 0 then writes the
manifest and renames the directory, so a checkpoint either exists whole or
not at all. `latest_valid()` walks checkpoints newest first and returns the
first whose files all match the manifest, saying why it skipped the others.
Loading never unpickles: the manifest and metadata are JSON and the tensor
payloads are read with weights_only=True.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tessel.train.logical import LogicalView, load_targets, save_state
from tessel.train.safe_dcp import METADATA_FILE, JsonMetadataWriter, SafeReader, UnsafeCheckpointError, read_metadata

FORMAT = "tessel-checkpoint-1"
MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(RuntimeError):
    pass


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


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(tmp: Path, final: Path, step: int, info: dict) -> None:
    """Checksum every file, write the manifest, rename tmp -> final (rank 0 only)."""
    files = {}
    for f in sorted(tmp.iterdir()):
        if f.is_file():
            files[f.name] = {"sha256": sha256_file(f), "bytes": f.stat().st_size}
    manifest = {"format": FORMAT, "step": step, "created": time.time(), **info, "files": files}
    with open(tmp / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again after a rollback
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)


def verify(path: Path) -> dict:
    """The manifest of a whole, untampered checkpoint; CheckpointError says what is wrong otherwise."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path.name}: no {MANIFEST} (an interrupted save?)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path.name}: {MANIFEST} is not valid JSON ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path.name}: not a {FORMAT} manifest")
    files = manifest.get("files", {})
    if METADATA_FILE not in files:
        raise CheckpointError(f"{path.name}: the manifest lists no {METADATA_FILE}")
    for name, want in files.items():
        f = path / name
        if Path(name).name != name or not f.is_file():
            raise CheckpointError(f"{path.name}: file {name} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"{path.name}: {name} has {size} bytes, the manifest says {want['bytes']} "
                                  "(truncated or overwritten)")
        got = sha256_file(f)
        if got != want["sha256"]:
            raise CheckpointError(f"{path.name}: {name} fails its checksum (sha256 {got[:12]}..., "
                                  f"manifest {want['sha256'][:12]}...): the file is corrupt")
    return manifest


def list_checkpoints(root: Path) -> list[Path]:
    """Committed checkpoint directories, newest step first."""
    root = Path(root)
    if not root.is_dir():
        return []
    dirs = [d for d in root.iterdir() if d.is_dir() and d.name.startswith(PREFIX) and d.name[len(PREFIX):].isdigit()]
    return sorted(dirs, key=lambda d: int(d.name[len(PREFIX):]), reverse=True)


def prune(root: Path, keep: int) -> None:
    """Delete all but the `keep` newest committed checkpoints."""
    for old in list_checkpoints(root)[keep:]:
        shutil.rmtree(old, ignore_errors=True)


def choose(root: Path, resume: str, log=print) -> Path | None:
    """checkpoint.resume: 'auto' -> the newest valid checkpoint under root (or None); a path -> that
    checkpoint, which must verify (no silent fallback)."""
    if resume == "auto":
        found = latest_valid(root, log)
        return None if found is None else found[0]
    verify(Path(resume))
    return Path(resume)


def latest_valid(root: Path, log=print) -> tuple[Path, dict] | None:
    """Newest checkpoint that verifies; each rejected one is reported with its reason."""
    for d in list_checkpoints(root):
        try:
            return d, verify(d)
        except CheckpointError as err:
            log(f"[tessel checkpoint] skipping invalid checkpoint {err}; falling back to the previous one")
    return None


@dataclass
class Pending:
    future: object
    tmp: Path
    final: Path
    step: int
    info: dict


class CheckpointManager:
    """Saves and loads the trainer's whole state; one per rank, all ranks call every method."""

    def __init__(self, root: str | Path, mesh, keep: int = 3, async_save: bool = False, log=None):
        self.root = Path(root)
        self.mesh = mesh
        self.keep = keep
        self.async_save = async_save
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.view = LogicalView(mesh)
        self.log = log or (lambda msg: print(msg, file=sys.stderr, flush=True) if self.rank == 0 else None)
        # a group of its own (gloo: DCP's plans travel on CPU): an async save's collectives run in a
        # background thread and must not interleave with the training step's
        self.group = dist.new_group(backend="gloo") if dist.is_initialized() else None
        self.pending: Pending | None = None

    # ---- save -----------------------------------------------------------------
    def save(self, step: int, runner, optimizer, info: dict) -> None:
        self.wait()
        final, tmp = step_dir(self.root, step), tmp_dir(self.root, step)
        if self.rank == 0:
            fresh_dir(tmp)
        self._barrier()
        state = save_state(runner, optimizer, self.view)
        writer = JsonMetadataWriter(tmp, sync_files=True)
        if self.async_save:
            fut = dcp.async_save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
            self.pending = Pending(fut, tmp, final, step, info)
        else:
            dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
            self.pending = Pending(None, tmp, final, step, info)
            self._finish()

    def poll(self) -> None:
        """Commit a finished async save (call once per step)."""
        if self.pending is not None and self.pending.future is not None and self.pending.future.done():
            self._finish()

    def wait(self) -> None:
        if self.pending is not None:
            if self.pending.future is not None:
                self.pending.future.result()
            self._finish()

    def _finish(self) -> None:
        p, self.pending = self.pending, None
        if p.future is not None:
            p.future.result()  # re-raises a failed background write
        if self.rank == 0:
            # DCP returns on the coordinator after every rank's files and the metadata are written
            commit(p.tmp, p.final, p.step, p.info)
            prune(self.root, self.keep)
            self.log(f"[tessel checkpoint] saved step {p.step} -> {p.final}")

    # ---- load -----------------------------------------------------------------
    def find(self, resume: str) -> tuple[Path, dict] | None:
        """'auto' -> newest valid checkpoint under root (or None); a path -> that checkpoint, verified."""
        choice = choose(self.root, resume, self.log) if self.rank == 0 else None
        choice = self._broadcast_path(choice)
        return None if choice is None else (choice, manifest_of(choice))  # rank 0 verified it

    def load(self, path: Path, runner, optimizer) -> dict:
        """Load the checkpoint at `path` into this rank's (possibly different) layout; returns the manifest."""
        manifest = manifest_of(path)
        md = read_metadata(path)
        targets, put_back = load_targets(runner, optimizer, self.view, md.state_dict_metadata)
        try:
            dcp.load(targets, storage_reader=SafeReader(path), process_group=self.group, no_dist=self.group is None)
        except CheckpointException as err:
            raise CheckpointError(f"{path}: could not be loaded: {_root_causes(err)}") from None
        for fqn, apply in put_back:
            apply(targets[fqn])
        custom = getattr(optimizer, "load_checkpoint_tensors", None)
        if custom is not None:  # it reads logical tensors; localize cuts this rank's tp/ep shard
            custom(SafeReader(path), md, localize=self.view.local_slice)
        return manifest

    def _barrier(self) -> None:
        if self.group is not None:
            dist.barrier(group=self.group)

    def _broadcast_path(self, path: Path | None) -> Path | None:
        """Rank 0's choice to everyone, as bytes in a tensor (no pickling of objects)."""
        if self.group is None:
            return path
        raw = str(path).encode() if path is not None else b""
        n = torch.tensor([len(raw)], dtype=torch.long)
        dist.broadcast(n, src=0, group=self.group)
        if int(n.item()) == 0:
            return None
        buf = torch.zeros(int(n.item()), dtype=torch.uint8)
        if self.rank == 0 and raw:
            buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.group)
        return Path(bytes(buf.tolist()).decode())


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
    """A checkpoint's manifest as written (verify() checks the files against it)."""
    return json.loads((Path(path) / MANIFEST).read_text())


__all__ = ["CheckpointManager", "CheckpointError", "UnsafeCheckpointError", "verify", "latest_valid",
           "list_checkpoints", "step_dir", "tmp_dir", "fresh_dir", "commit", "prune", "choose", "manifest_of"]
