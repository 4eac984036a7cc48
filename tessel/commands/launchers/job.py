"""What every scheduler's job is made of: a checked recipe, its nodes, and the command each node runs.

A job is N nodes x G ranks: one torchrun per node starts that node's G ranks and
joins a c10d rendezvous hosted by the first node; every rank runs `tessel train`
on the frozen recipe (the recipe and its --set overrides, validated and written
back whole, so the job runs exactly what was checked) with `--resume auto`, so a
requeued or restarted job continues from the run's newest valid checkpoint.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from tessel.config import Config, ConfigError, at_least, check_layout, to_toml
from tessel.observe.trackers import check_installed
from tessel.commands.launch import shutdown_args


@dataclass
class ClusterJob:
    """A recipe checked against the shape of the allocation it will run on."""
    cfg: Config
    nodes: int
    per_node: int  # ranks per node: GPUs, or processes on a CPU cluster
    gpus: bool  # G is GPUs per node (nccl); False: a CPU cluster, G processes per node
    grace_s: int  # seconds a signalled run gets to finish its step and save

    @property
    def world(self) -> int:
        return self.nodes * self.per_node

    def recipe_toml(self) -> str:
        """The recipe the ranks run, checked, without a resume (the job passes --resume auto): the fields that
        differ from their defaults, so that it reads like the recipe it came from."""
        return to_toml(self.cfg, exclude_defaults=True)


def check_job(cfg: Config, nodes: int, gpus_per_node: int | None, procs_per_node: int | None,
              grace_s: int, requeue: bool = True) -> ClusterJob:
    """The allocation against the recipe, before anything is written: ConfigError naming the flag or field."""
    at_least("--nodes", nodes, 1)
    if (gpus_per_node is None) == (procs_per_node is None):
        raise ConfigError("--gpus-per-node", "give either --gpus-per-node G (G ranks per node, one per GPU) or "
                          "--procs-per-node P (a CPU cluster: P ranks per node)")
    at_least("--gpus-per-node", gpus_per_node, 1)
    at_least("--procs-per-node", procs_per_node, 1)
    at_least("--grace", grace_s, 1)
    per_node = gpus_per_node or procs_per_node
    flag = "--gpus-per-node" if gpus_per_node else "--procs-per-node"
    world = cfg.parallel.world_size
    if world != nodes * per_node:
        terms = "pp*dp*ep*tp" + (" + ps_servers" if cfg.parallel.dp_arch == "ps" else "")
        raise ConfigError("--nodes", f"--nodes {nodes} x {flag} {per_node} = {nodes * per_node} ranks, but the "
                          f"recipe's layout needs {world} ({terms})")
    r = cfg.runtime
    if gpus_per_node is None and (r.device == "cuda" or r.backend == "nccl"):
        field = "runtime.device" if r.device == "cuda" else "runtime.backend"
        raise ConfigError(field, f"asks for GPUs, but --procs-per-node launches on CPUs; use --gpus-per-node")
    if requeue and cfg.checkpoint.every == 0:
        raise ConfigError("checkpoint.every", "is 0: a preempted or requeued job would start over; set it (a "
                          "preemption also saves at once), or pass --no-requeue")
    cfg = cfg.model_copy(deep=True)
    cfg.runtime.nnodes, cfg.runtime.nproc_per_node = nodes, per_node  # tp groups stay inside a node
    cfg.checkpoint.resume = None
    check_layout(cfg, world_size=nodes * per_node)
    return ClusterJob(cfg, nodes, per_node, gpus_per_node is not None, grace_s)


def check_inputs(cfg: Config) -> None:
    """What the ranks need that can be checked from here (a shared filesystem, the same environment): the
    trackers' packages, the data, the initial weights."""
    from tessel.models.build import check_init_from  # deferred: loads torch (the model on the meta device)
    from tessel.train.data import validate_data  # deferred: loads torch
    check_installed(cfg)
    validate_data(cfg)
    check_init_from(cfg.model)


def torchrun_argv(job: ClusterJob, recipe: str, endpoint: str, rdzv_id: str, python: str = sys.executable
                  ) -> list[str]:
    """One node's torchrun: G ranks joining a c10d rendezvous on `endpoint` (the first node's address).

    The node whose address it is hosts the rendezvous store; torchrun tells by matching the address
    against its own (and where several nodes share a machine, the first to bind the port hosts it)."""
    return [python, "-m", "torch.distributed.run", f"--nnodes={job.nodes}", f"--nproc-per-node={job.per_node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}", "--max-restarts=0",
            *shutdown_args(job.grace_s), "-m", "tessel", "train", recipe, "--resume", "auto"]
