"""Launching: re-execute under torchrun when needed, and the per-rank entry point."""

from __future__ import annotations

import os
import subprocess
import sys
import traceback

from tessel.config import Config, check_layout

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


def torchrun_command(cfg: Config, argv: list[str], max_restarts: int = 0, nnodes: str | None = None,
                     nproc: int | None = None) -> list[str]:
    """`python -m torch.distributed.run --standalone` with one process per rank of the layout.

    With an elastic node range (nnodes "MIN:MAX") the rendezvous is c10d on
    runtime's endpoint (this host by default), see tessel.train.elastic.
    """
    nproc = nproc or cfg.parallel.world_size
    if nnodes and ":" in nnodes:
        from tessel.train.elastic import rendezvous_args
        rdzv = rendezvous_args(nnodes)
    else:
        rdzv = ["--standalone", "--nnodes=1"]
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}", "-m", "tessel", *argv]


def reexec(cfg: Config, argv: list[str], max_restarts: int = 0, nnodes: str | None = None,
           nproc: int | None = None) -> int:
    """Run this same command under torchrun and return its exit code."""
    env = dict(os.environ)
    # one thread per rank unless told otherwise; also silences torchrun's OMP warning
    env.setdefault("OMP_NUM_THREADS", str(cfg.runtime.threads_per_rank))
    env.setdefault("PYTHONUNBUFFERED", "1")
    _prepare_data(cfg)  # build the corpus cache once, not once per rank
    proc = subprocess.run(torchrun_command(cfg, argv, max_restarts, nnodes, nproc), env=env)
    return proc.returncode


def _prepare_data(cfg: Config) -> None:
    from tessel.train.data import load_tokens
    load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)


def run_rank(cfg: Config) -> None:
    """Entry point of one rank under torchrun; never returns (see shutdown_and_exit)."""
    from tessel.runtime import shutdown_and_exit
    try:
        summary = train_rank(cfg)
        if int(os.environ.get("RANK", 0)) == 0:
            from tessel.observe.report import print_summary
            print_summary(summary)
        code = 0
    except Exception:  # noqa: BLE001 - report and exit non-zero; torchrun stops the others
        print(f"[rank {os.environ.get('RANK')}] " + traceback.format_exc(), file=sys.stderr)
        code = 1
    shutdown_and_exit(code)


def train_rank(cfg: Config):
    import torch
    import torch.distributed as dist

    from tessel.mesh import make_mesh
    from tessel.models.gpt import GPT
    from tessel.parallelize import parallelize
    from tessel.runtime import init_distributed
    from tessel.train.trainer import Trainer

    r = cfg.runtime
    device = init_distributed(r.device, r.backend, r.threads_per_rank, r.timeout_s)
    if r.elastic:
        from tessel.train.elastic import replan_for_world
        cfg = replan_for_world(cfg, dist.get_world_size(), dist.get_rank())
    check_layout(cfg, world_size=dist.get_world_size())
    if cfg.parallel.dp_arch == "ps":  # no mesh: the servers are ranks outside the dp layout
        from tessel.train.ps_trainer import train_rank_ps
        return train_rank_ps(cfg, device)
    p = cfg.parallel
    mesh = make_mesh(p.axis_sizes, order=p.rank_order, device=device)
    rank = dist.get_rank()
    if rank == 0:
        print(mesh.describe(), flush=True)
    if r.topology and not r.nproc_per_node:  # a `tessel probe` file knows the node size
        from tessel.comm.topology import Topology
        mesh.check_topology(Topology.load(r.topology).nproc_per_node)
    else:
        mesh.check_topology(r.nproc_per_node)
    if cfg.train.deterministic:
        torch.use_deterministic_algorithms(True)
    torch.manual_seed(cfg.train.seed)  # same initial weights on every rank before any split
    model = GPT(cfg.model).to(device)
    runner = parallelize(model, mesh, cfg)
    return Trainer(cfg, mesh, model, runner, rank).fit()
