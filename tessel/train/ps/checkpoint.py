"""Checkpoints of a parameter-server run: its state is on the servers, its format the trainer's.

Worker 0's guard checkpoints through the trainer's own path (tessel.train.fault.guard,
tessel.train.checkpoint.manager): same manifest, atomic commit, checksums,
pruning, async writes on a thread, preemption saves. Only where the tensors
come from differs: ServerSnapshot asks every server for a snapshot (weights,
AdamW moments, update count: tessel.parallel.ps.parameter_server) and hands
them over as the logical, unsharded tensors every layout writes: `model/<name>`,
`optim/<name>/{exp_avg,exp_avg_sq,step}`. So a PS checkpoint resumes a PS run
with any number of servers, or an all-reduce run in any layout, and a PS run
resumes from an all-reduce checkpoint.

Worker 0 writes alone; the other workers do not stop (under BSP they wait at
the next barrier while it snapshots; under ASP and SSP they go on and the
snapshot is fuzzy, see tessel.parallel.ps.parameter_server). On resume the
servers take their key ranges of the checkpoint before they serve
(restore_servers); the workers' guards restore the step, data position and
schedule from its manifest, and their weights come with the first pull.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp

from tessel.config import Config
from tessel.parallel.ps.parameter_server import ParameterServer
from tessel.parallel.runner import Runner
from tessel.train.checkpoint.logical import OPTIM_PREFIX, LogicalView, model_tensors
from tessel.train.checkpoint.manager import choose, manifest_of, run_model
from tessel.train.checkpoint.optimizer_state import PutBack
from tessel.train.checkpoint.safe_dcp import SafeReader, read_metadata
from tessel.train.fault.guard import checkpoint_root

STATE_KEYS = ("exp_avg", "exp_avg_sq")  # AdamW's elementwise state; its step is the update count


def _param_names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in model.named_parameters()}


class ServerSnapshot:
    """A worker's view of the training state: the servers hold it (tessel.train.checkpoint.tensors.StateTensors)."""

    def __init__(self, ps: ParameterServer, runner: Runner, model: torch.nn.Module, mode: str):
        self.ps, self.runner, self.model, self.mode = ps, runner, model, mode

    def save_tensors(self, view: LogicalView) -> tuple[dict[str, torch.Tensor], dict]:
        """The servers' state as the trainer's logical tensors (owned copies: training may go on), and
        their update count, which a PS run resumes the learning rate from."""
        tensors, updates = snapshot_tensors(self.ps, self.runner, self.model)
        return tensors, {"ps_updates": updates, "ps_mode": self.mode}

    def load_targets(self, view: LogicalView, saved: dict) -> tuple[dict[str, torch.Tensor], list[PutBack]]:
        return {}, []  # the servers took their key ranges before serving (restore_servers)

    def after_load(self, path: Path, metadata, manifest: dict, view: LogicalView) -> None:
        self.ps.step_count = int(manifest["step"])  # this worker's pushes go on from the checkpoint's step


def snapshot_tensors(ps: ParameterServer, runner: Runner,
                     model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], int]:
    """The servers' state as the trainer's logical tensors; (tensors, updates)."""
    flat, state, updates = ps.snapshot()
    names = _param_names(model)
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


def restore_servers(cfg: Config, ps: ParameterServer, model: torch.nn.Module, run_id: str | None) -> None:
    """On a server, before serve(): its key range of the checkpoint checkpoint.resume names (auto: run
    `run_id`'s newest valid one of this model), verified; nothing when there is none."""
    if cfg.checkpoint.resume is None:
        return
    # the same choice as the workers' guards make (worker 0 reports what it skips)
    path = choose(checkpoint_root(cfg), cfg.checkpoint.resume, lambda msg: None, run_model(cfg), run_id)
    if path is None:
        return
    manifest = manifest_of(path)
    flat, state = _load_flat(ps, model, path)
    same_mode = manifest.get("ps_mode") == cfg.parallel.ps_mode and "ps_updates" in manifest
    # lr follows updates (BSP) or updates per worker (ASP, SSP): see tessel.parallel.ps.parameter_server
    per_step = 1 if cfg.parallel.ps_mode == "bsp" else len(ps.workers)
    ps.restore(flat, state, int(manifest["ps_updates"]) if same_mode else int(manifest["step"]) * per_step)


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
