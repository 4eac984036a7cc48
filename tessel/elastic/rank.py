"""One rank of `tessel train`: its entry under torchrun, its environment, how it ends.

The launcher (tessel.commands.launch) starts each rank as `python -m tessel _rank CONFIG` with the
environment rank_environment gives; under a user's own torchrun `tessel train` calls run_rank
directly. A rank trains through tessel.elastic.adaptive.run_layouts (the world it finds, re-planned,
and the layouts a slow rank makes it change to) or, for a parameter server, tessel.train.ps.trainer.
A rank that stops on a signal or a fatal error reports through the control folder, so that torchrun
does not restart it.

Importing this module loads no torch: the imports marked `# deferred:` load it.
"""

from __future__ import annotations

import os
import sys
import traceback

from tessel.config import Config, ConfigError, check_layout
from tessel.errors import FatalError
from tessel.train.fault.preempt import ControlDir, Stopped, StopRequest


def rank_environment(cfg: Config, environ) -> dict[str, str]:
    """The environment torchrun's ranks start in: one thread per rank unless told otherwise (this also silences
    torchrun's OMP warning), unbuffered output, and for ranks that may take a GPU the CUDA allocator's default
    (expandable segments) unless the user set one (tessel.runtime.cuda_allocator_env)."""
    from tessel.runtime import cuda_allocator_env  # deferred: loads torch (loaded already when this runs)
    env = dict(environ)
    env.setdefault("OMP_NUM_THREADS", str(cfg.runtime.threads_per_rank))
    env.setdefault("PYTHONUNBUFFERED", "1")
    if cfg.runtime.device != "cpu":  # "auto" takes GPUs where there are; the setting is inert where CUDA never starts
        env.update(cuda_allocator_env(env))
    return env


def finished_already(cfg: Config, run_id: str, explicit_step: int | None, say=print) -> bool:
    """Resuming a run whose checkpoint is at train.steps: say so, print its summary, train nothing."""
    from tessel.train.run_dir import checkpoint_root, newest_step  # deferred: loads torch (checkpoints)
    resume = cfg.checkpoint.resume
    if resume is None:
        return False
    step = explicit_step if resume != "auto" else newest_step(checkpoint_root(cfg), run_id, cfg)
    if step is None or step < cfg.train.steps:
        return False
    say(f"[tessel] run {run_id} is already finished: its checkpoint is at step {step} and train.steps is "
        f"{cfg.train.steps}; nothing to train (raise train.steps to continue it)")
    from tessel.observe.report import print_summary  # deferred: rich's tables, for the last line only
    from tessel.train.trainer import summary_from_metrics  # deferred: loads torch and every strategy
    print_summary(summary_from_metrics(cfg))
    return True


def run_rank(cfg: Config, control: ControlDir | None = None, run_id: str | None = None,
             overwrite: bool = False) -> None:
    """Entry point of one rank under torchrun; never returns (see tessel.runtime.shutdown_and_exit).

    Under the launcher (`control` given) a rank that stops on a signal or a fatal error exits 0 and
    reports through the control folder, so that torchrun does not restart it; alone under a user's
    torchrun it exits 128+signal or 1."""
    from tessel.runtime import shutdown_and_exit  # deferred: loads torch (see the module's note)
    rank = int(os.environ.get("RANK", 0))
    if control is not None and (control.fatal() is not None or control.stop_requested()):
        shutdown_and_exit(0)  # a restart after the run was told to end: nothing to do
    claimed = None
    code = 0
    try:
        if control is None and rank == 0:  # no launcher: rank 0 owns the folder
            from tessel.train.run_dir import claim  # deferred: loads torch (checkpoints)
            claimed = claim(cfg, resume=cfg.checkpoint.resume is not None, overwrite=overwrite)
            run_id = claimed.run_id
        summary = train_rank(cfg, run_id, StopRequest(control))
        if summary is not None and _rank_now(rank) == 0:  # None: evicted (fault.slow_policy = "evict")
            from tessel.observe.report import print_summary  # deferred: rich's tables, for the last line only
            print_summary(summary)
    except Stopped as stop:
        code = _stopped(stop, rank, control)
    except (ConfigError, FatalError) as err:
        code = _fatal(err, rank, control)
    except Exception:  # noqa: BLE001 - report and exit non-zero; torchrun stops the others
        print(f"[rank {rank}] " + traceback.format_exc(), file=sys.stderr)
        code = 1
    finally:
        if claimed is not None:
            claimed.release()
    shutdown_and_exit(code)


def _rank_now(rank: int) -> int:
    """This rank's number now: an eviction renumbers the ranks that stay (tessel.elastic.adaptive.regroup)."""
    import torch.distributed as dist  # deferred: loaded by the run already
    return dist.get_rank() if dist.is_initialized() else rank


def _stopped(stop: Stopped, rank: int, control: ControlDir | None) -> int:
    if rank == 0:
        print(f"[tessel] {stop}: resume with --resume auto", file=sys.stderr, flush=True)
        if control is not None:
            control.report_stopped(stop.signum, stop.step)
    return 0 if control is not None else 128 + stop.signum


def _fatal(err: Exception, rank: int, control: ControlDir | None) -> int:
    """A failure a restart would repeat: one line from rank 0, no traceback, no restart."""
    what = "invalid config: " if isinstance(err, ConfigError) else ""
    line = f"error: {what}{err}"
    if rank == 0:
        print(line, file=sys.stderr, flush=True)
        if control is not None:
            control.report_fatal(line)
    return 0 if control is not None else 1


def train_rank(cfg: Config, run_id: str | None = None, stop: StopRequest | None = None):
    from tessel.elastic.adaptive import run_layouts  # deferred: loads torch and every strategy
    from tessel.runtime import init_distributed  # deferred: loads torch
    from tessel.train.ps.trainer import train_rank_ps  # deferred: loads torch and the trainer

    r = cfg.runtime
    if stop is not None:  # the ranks stop after their step on SIGINT, SIGTERM, SIGHUP
        stop.install()
    device = init_distributed(r.device, r.backend, r.threads_per_rank, r.timeout_s)
    if cfg.parallel.dp_arch == "ps":  # no mesh over the world: the servers are ranks outside the dp layout
        import torch.distributed as dist
        check_layout(cfg, world_size=dist.get_world_size())
        return train_rank_ps(cfg, device, run_id, stop)
    # the mesh, the model, the runner and the trainer, again whenever a slow rank makes the run change layout
    return run_layouts(cfg, device, run_id, stop)
