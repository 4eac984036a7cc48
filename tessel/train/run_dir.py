"""One run per output folder: a lock for the run's lifetime, an identity, and no trampling of another run.

A run claims `logging.out_dir` before any rank starts (tessel.commands.launch):
- **Lock.** `.tessel.lock` holds the owner's host, pid and process start time,
  created atomically (a hard link, so two claimants cannot both win). A lock
  whose process is gone (same host, no such pid, or the pid reused by another
  process) is stale and taken over with a message; a live one, or one from
  another host, refuses the claim.
- **Identity.** `run.json` names the run (`run_id`). Checkpoints carry it in
  their manifest, so pruning and `--resume auto` touch only the run's own
  (tessel.train.checkpoint.manager).
- **Fresh or resumed.** A fresh run refuses a folder that holds another run's
  files, unless told to `--overwrite` them (which removes exactly those files)
  or to `--resume` (which continues the run that lives there: run.json's id,
  or, in a folder without one, the id of its newest checkpoint).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from tessel.config import Config, ConfigError
from tessel.train.checkpoint.manager import PREFIX, latest_valid, newest_run_id
from tessel.train.checkpoint.manifest import run_model, run_of

LOCK = ".tessel.lock"
RUN_FILE = "run.json"
# what a run writes into its out_dir (tessel.observe, tessel.parallel.pipeline's timeline)
RUN_FILES = ("run.json", "metrics.jsonl", "tensorboard", "curves.png", "pipeline_trace.json", "pipeline_gantt.png")


def checkpoint_root(cfg: Config) -> Path:
    return Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (/proc), to tell a reused pid apart."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.rindex(")") + 2:].split()[19]


def _alive(owner: dict) -> bool:
    pid = int(owner.get("pid", -1))
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's live process
    recorded = owner.get("start_time")
    return recorded is None or _start_time(pid) in (None, recorded)


def _slurm_attempt() -> dict:
    """The Slurm job and attempt that holds a lock (tessel launch slurm requeues jobs), if any."""
    job = os.environ.get("SLURM_JOB_ID")
    return {} if job is None else {"slurm_job": job, "slurm_attempt": int(os.environ.get("SLURM_RESTART_COUNT", 0))}


def _earlier_attempt(owner: dict, me: dict) -> bool:
    """A lock left by an earlier attempt of the same Slurm job: Slurm runs one attempt at a time, so its
    holder is gone even when it was on another host (a requeued job's rank 0 may land elsewhere)."""
    return ("slurm_job" in me and owner.get("slurm_job") == me["slurm_job"]
            and int(owner.get("slurm_attempt", 0)) < me["slurm_attempt"])


class OutDirLock:
    """An exclusive claim on a folder for a process's lifetime (see the module docstring)."""

    def __init__(self, folder: Path, field: str = "logging.out_dir", say=print):
        self.path, self.field, self.say = Path(folder) / LOCK, field, say
        self.held = False

    def acquire(self, run_id: str) -> None:
        me = {"host": socket.gethostname(), "pid": os.getpid(), "start_time": _start_time(os.getpid()),
              "run_id": run_id, "since": time.strftime("%Y-%m-%d %H:%M:%S"), **_slurm_attempt()}
        for _ in range(3):
            if self._try_create(me):
                self.held = True
                return
            owner = self._owner()
            if owner is None:
                continue  # released between our attempts
            if not _earlier_attempt(owner, me) and (owner.get("host") != me["host"] or _alive(owner)):
                raise ConfigError(self.field, f"{self.path.parent} is in use by run {owner.get('run_id')} (pid "
                                  f"{owner.get('pid')} on {owner.get('host')} since {owner.get('since')}); wait "
                                  f"for it to finish or choose another folder (if that run is gone, delete "
                                  f"{self.path})")
            self._take_over(owner)
        raise ConfigError(self.field, f"could not lock {self.path}: other runs keep claiming it")

    def _try_create(self, me: dict) -> bool:
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}")
        tmp.write_text(json.dumps(me))
        try:
            os.link(tmp, self.path)  # atomic: fails if the lock exists
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    def _owner(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, ValueError):
            return {}  # unreadable: treated as a dead owner on this host below only if the host matches

    def _take_over(self, owner: dict) -> None:
        stale = self.path.with_name(f"{LOCK}.stale-{uuid.uuid4().hex[:8]}")
        try:
            os.rename(self.path, stale)  # only one claimant wins this rename
        except FileNotFoundError:
            return
        stale.unlink(missing_ok=True)
        self.say(f"[tessel] taking over the stale lock of {self.path.parent} (pid {owner.get('pid')} on "
                 f"{owner.get('host')} is no longer running)")

    def name(self, run_id: str) -> None:
        """Record the run id once it is settled (the lock was taken before)."""
        doc = {**(self._owner() or {}), "run_id": run_id}
        tmp = self.path.with_name(f"{LOCK}.{os.getpid()}")
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.path)

    def release(self) -> None:
        if self.held and (self._owner() or {}).get("pid") == os.getpid():
            self.path.unlink(missing_ok=True)
        self.held = False


def writable_folder(path: Path, field: str) -> None:
    """Create `path` if needed and prove it takes files; ConfigError naming `field` otherwise."""
    if path.exists() and not path.is_dir():
        raise ConfigError(field, f"{path} is a file, not a folder")
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".tessel-write-test-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as err:
        raise ConfigError(field, f"{path} is not writable ({err.strerror or err})") from None


def run_files(cfg: Config) -> list[str]:
    """The names of another run's files in out_dir and its checkpoints (empty: the folder is free)."""
    out = Path(cfg.logging.out_dir)
    found = [name for name in RUN_FILES if (out / name).exists()]
    root = checkpoint_root(cfg)
    if root.is_dir():
        found += sorted(d.name for d in root.iterdir() if d.name.startswith((PREFIX, f".tmp-{PREFIX}")))
    return found


def read_run_id(out_dir: Path) -> str | None:
    try:
        return str(json.loads((Path(out_dir) / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _write_run_file(out_dir: Path, run_id: str, elastic_id: str | None) -> None:
    doc = {"run_id": run_id, "created": time.strftime("%Y-%m-%d %H:%M:%S"), "host": socket.gethostname(),
           "torchelastic_run_id": elastic_id}
    tmp = Path(out_dir) / f".{RUN_FILE}.{os.getpid()}"
    tmp.write_text(json.dumps(doc, indent=1))
    os.replace(tmp, Path(out_dir) / RUN_FILE)


def remove_run_files(cfg: Config, old_run: str | None) -> None:
    """--overwrite: delete what the previous run wrote (its files in out_dir, its checkpoints), nothing else."""
    out = Path(cfg.logging.out_dir)
    for name in RUN_FILES:
        target = out / name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        elif target.exists() or target.is_symlink():
            target.unlink()
    root = checkpoint_root(cfg)
    inside = root.resolve().is_relative_to(out.resolve())
    if root.is_dir():
        for d in root.iterdir():
            mine = inside or (old_run is not None and run_of(d) == old_run)
            if d.name.startswith((PREFIX, f".tmp-{PREFIX}")) and mine and d.is_dir():
                shutil.rmtree(d)


@dataclass
class Claim:
    """A run's hold on its out_dir: who it is, and the lock to release at the end."""
    run_id: str
    lock: OutDirLock

    def release(self) -> None:
        self.lock.release()


def claim(cfg: Config, resume: bool, overwrite: bool, say=print) -> Claim:
    """Check the folders, lock out_dir, and settle the run's identity (see the module docstring).

    Raises ConfigError (exit 2 in the CLI) when the folders are unusable, taken, or hold another run."""
    out = Path(cfg.logging.out_dir)
    writable_folder(out, "logging.out_dir")
    if cfg.checkpoint.every or cfg.checkpoint.resume:
        writable_folder(checkpoint_root(cfg), "checkpoint.dir" if cfg.checkpoint.dir else "logging.out_dir")
    lock = OutDirLock(out, say=say)
    existing = read_run_id(out)
    lock.acquire(existing or "new")
    try:
        run_id = _settle_identity(cfg, existing, resume, overwrite, say)
        lock.name(run_id)
    except BaseException:
        lock.release()
        raise
    return Claim(run_id, lock)


def _settle_identity(cfg: Config, existing: str | None, resume: bool, overwrite: bool, say) -> str:
    out = Path(cfg.logging.out_dir)
    elastic_id = os.environ.get("TORCHELASTIC_RUN_ID")
    restarted = existing is not None and elastic_id is not None and _elastic_id(out) == elastic_id
    if restarted or (resume and not overwrite):  # the run that lives here goes on
        run_id = existing or newest_run_id(checkpoint_root(cfg)) or uuid.uuid4().hex[:12]
    else:
        others = run_files(cfg)
        if others and not overwrite:
            raise ConfigError("logging.out_dir", f"{out} holds the files of run {existing or '(unnamed)'} "
                              f"({', '.join(others[:4])}{', ...' if len(others) > 4 else ''}); pass --resume auto "
                              "to continue it, --overwrite to replace it, or choose another logging.out_dir")
        if others:
            say(f"[tessel] --overwrite: removing the files of run {existing or '(unnamed)'} in {out}")
            remove_run_files(cfg, existing)
        run_id = uuid.uuid4().hex[:12]
    if existing != run_id or elastic_id:
        _write_run_file(out, run_id, elastic_id)
    return run_id


def newest_step(root: Path, run_id: str, cfg: Config) -> int | None:
    """The step of the run's newest checkpoint that verifies (what --resume auto would continue)."""
    found = latest_valid(root, log=lambda _msg: None, model=run_model(cfg), run_id=run_id)
    return None if found is None else int(found[1]["step"])


def _elastic_id(out: Path) -> str | None:
    try:
        return json.loads((out / RUN_FILE).read_text()).get("torchelastic_run_id")
    except (OSError, ValueError, AttributeError):
        return None
