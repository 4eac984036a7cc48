"""Checkpoints of a parameter-server run, in the all-reduce trainer's format.

Worker 0 asks the servers for a snapshot (tessel.parallel.ps.parameter_server: weights, AdamW
moments, update count) and writes it alone, as the logical, unsharded tensors
that tessel.train.checkpoint.manager writes for every layout: `model/<name>`,
`optim/<name>/{exp_avg,exp_avg_sq,step}`, plus the same manifest (sampler,
scheduler, optimizer hyper-parameters). The same atomic commit (temporary
directory, checksums, rename) and pruning apply. So a PS checkpoint resumes a
PS run with any number of servers, or an all-reduce run in any layout, and a
PS run resumes from an all-reduce checkpoint.

The other workers do not stop: under BSP they wait at the next barrier while
worker 0 writes (with checkpoint.async_save worker 0 writes on a thread and
nobody waits); under ASP and SSP they go on (the snapshot is fuzzy there, see
tessel.parallel.ps.parameter_server). On resume every rank reads the checkpoint: servers
take their key ranges of it, workers their step and data position.
"""

from __future__ import annotations

import concurrent.futures as cf
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from tessel.config import Config
from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.train.checkpoint.logical import OPTIM_PREFIX, model_tensors
from tessel.train.checkpoint.manager import (choose, commit, disk_full_error, fresh_dir, manifest_of, prune, run_model,
                                             step_dir, tmp_dir)
from tessel.train.checkpoint.safe_dcp import JsonMetadataWriter, SafeReader, read_metadata
from tessel.train.fault.guard import checkpoint_root, run_info
from tessel.train.optim import build_optimizer, build_scheduler, lr_at

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's elementwise state; its step is the update count


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


def snapshot_tensors(ps: ParameterServer, runner) -> tuple[dict[str, torch.Tensor], int]:
    """The servers' state as the trainer's logical tensors; (tensors, updates)."""
    flat, state, updates = ps.snapshot()
    names = _param_names(runner.model)
    out, off = {}, 0
    by_id = {}
    for p in ps.params:  # the PS key space: parameters in registration order
        n, name = p.numel(), names[id(p)]
        by_id[id(p)] = flat[off:off + n].view_as(p).to(p.dtype)
        for key in STATE_KEYS:
            out[f"{OPTIM_PREFIX}{name}/{key}"] = state[key][off:off + n].view_as(p).clone()
        out[f"{OPTIM_PREFIX}{name}/step"] = torch.tensor(float(updates))
        off += n
    for name, t in model_tensors(runner).items():  # tied names and buffers too, as the trainer saves them
        out[f"model/{name}"] = by_id.get(id(t), t.detach()).clone()
    return out, updates


def manifest_info(cfg: Config, model: torch.nn.Module, step: int, sampler_state: dict, updates: int) -> dict:
    """What tessel.train.fault.guard saves beside the tensors, for the state after `step` steps."""
    t = cfg.train
    opt = build_optimizer(list(model.parameters()), t)  # the trainer's groups and hyper-parameters
    sched = build_scheduler(opt, t).state_dict()
    factor = lr_at(step, t) / t.lr  # LambdaLR's multiplier at `step`, as the trainer's would stand
    sched.update(last_epoch=step, _step_count=step + 1, _last_lr=[b * factor for b in sched["base_lrs"]])
    for g in opt.param_groups:  # a throwaway optimizer: its groups say what the trainer's would
        g["lr"] = g["initial_lr"] * factor
    return {**run_info(cfg, cfg.parallel.world_size, sampler_state, sched, opt.param_groups),
            "ps_updates": updates, "ps_mode": cfg.parallel.ps_mode}


class Writer:
    """Worker 0's checkpoints: the servers' snapshot is taken at once; it is written at once, or
    with checkpoint.async_save on a background thread while training goes on. run_id: as for
    tessel.train.checkpoint.manager.CheckpointManager (the manifest's owner; pruning counts only its own)."""

    def __init__(self, cfg: Config, ps: ParameterServer, runner, log=print, run_id: str | None = None):
        self.cfg, self.ps, self.runner, self.log, self.run_id = cfg, ps, runner, log, run_id
        self.pool = cf.ThreadPoolExecutor(1, thread_name_prefix="tessel-ps-ckpt") if cfg.checkpoint.async_save else None
        self.pending: cf.Future | None = None

    def save(self, step: int, sampler_state: dict) -> None:
        """The state after `step` steps, committed atomically as `step_<step>`; prunes to checkpoint.keep."""
        self.wait()  # one write at a time; a failed one raises here, on the training thread
        tensors, updates = snapshot_tensors(self.ps, self.runner)  # owned copies: training may go on
        info = manifest_info(self.cfg, self.runner.model, step, sampler_state, updates)
        if self.pool is None:
            self._write(tensors, step, info)
        else:
            self.pending = self.pool.submit(self._write, tensors, step, info)

    def wait(self) -> None:
        if self.pending is not None:
            pending, self.pending = self.pending, None
            pending.result()

    def _write(self, tensors: dict, step: int, info: dict) -> None:
        root = checkpoint_root(self.cfg)
        final, tmp = step_dir(root, step), tmp_dir(root, step)
        try:
            fresh_dir(tmp)
            dcp.save(tensors, storage_writer=JsonMetadataWriter(tmp, sync_files=True), no_dist=True)
            commit(tmp, final, step, info, self.run_id)
        except (OSError, CheckpointException) as err:
            full = disk_full_error(err, tmp, root, self.run_id)
            if full is None:
                raise
            raise full from None
        prune(root, self.cfg.checkpoint.keep, self.run_id)
        self.log(f"[tessel checkpoint] saved step {step} ({info['ps_updates']} server updates) -> {final}")


def find(cfg: Config, log=print, run_id: str | None = None) -> tuple[Path, dict] | None:
    """The checkpoint checkpoint.resume names ('auto': run `run_id`'s newest valid one of this model, or
    None), verified."""
    if cfg.checkpoint.resume is None:
        return None
    path = choose(checkpoint_root(cfg), cfg.checkpoint.resume, log, model=run_model(cfg), run_id=run_id)
    return None if path is None else (path, manifest_of(path))


def restore(cfg: Config, ps: ParameterServer, model: torch.nn.Module, path: Path, manifest: dict) -> int:
    """Servers load their key ranges; every rank returns the step to continue from (find checked the model)."""
    step = int(manifest["step"])
    if ps.is_server:
        flat, state = _load_flat(ps, model, path)
        same_mode = manifest.get("ps_mode") == cfg.parallel.ps_mode and "ps_updates" in manifest
        # lr follows updates (BSP) or updates per worker (ASP, SSP): see tessel.parallel.ps.parameter_server
        per_step = 1 if cfg.parallel.ps_mode == "bsp" else len(ps.workers)
        ps.restore(flat, state, int(manifest["ps_updates"]) if same_mode else step * per_step)
    ps.step_count = step
    return step


def _load_flat(ps: ParameterServer, model: torch.nn.Module, path: Path) -> tuple[torch.Tensor, dict]:
    saved = read_metadata(path).state_dict_metadata
    names = _param_names(model)
    targets = {}
    for p in ps.params:
        name = names[id(p)]
        targets[f"model/{name}"] = torch.empty_like(p, dtype=torch.float32)
        for key in STATE_KEYS:
            fqn = f"{OPTIM_PREFIX}{name}/{key}"
            if fqn in saved:  # a run without moments yet (or an SGD one) starts them at zero
                targets[fqn] = torch.zeros_like(p, dtype=torch.float32)
    dcp.load(targets, storage_reader=SafeReader(path), no_dist=True)
    flat = torch.cat([targets[f"model/{names[id(p)]}"].reshape(-1) for p in ps.params])
    state = {key: torch.cat([targets.get(f"{OPTIM_PREFIX}{names[id(p)]}/{key}", torch.zeros_like(p)).reshape(-1)
                             for p in ps.params]) for key in STATE_KEYS}
    return flat, state
