"""Launching `tessel train`: every check before any process, torchrun under supervision, and each rank's entry.

The launcher (no torchrun in the environment) checks everything a user can get
wrong before a single rank exists (exit 2, one line naming the field), claims
the output folder, then runs torchrun under a tessel.commands.supervise.Supervisor with
one process per rank. Ranks start as `python -m tessel _rank CONFIG`, reading
the validated config from the run's control folder: paths and values travel as
values, never re-parsed from the command line.

Under torchrun started by the user (many nodes, their own rendezvous), `tessel
train` skips the launcher: every rank validates its config, and rank 0 claims
the output folder.

Importing this module loads no torch (a second): `tessel train` refuses a bad
config before it would have loaded. The imports marked `# deferred:` are the
ones that load it (the data, the checkpoints, the runtime, the trainer) or,
for the memory check, the cost model.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

from tessel.comm.topology import Topology
from tessel.config import Config, ConfigError, at_least, check_layout
from tessel.errors import FatalError
from tessel.observe.trackers import check_installed
from tessel.commands.supervise import Supervisor
from tessel.elastic.dp_only import rendezvous_args, replan, shutdown_args
from tessel.train.fault.preempt import ControlDir, Stopped, StopRequest

TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "LOCAL_RANK")
RDZV_ENV = "TESSEL_RDZV_ENDPOINT"


def under_torchrun() -> bool:
    return all(k in os.environ for k in TORCHRUN_ENV)


# ---- the command line, checked ------------------------------------------------------------------
@dataclass
class LaunchOptions:
    """`tessel train`'s flags beyond the recipe."""
    max_restarts: int = 0
    resume: str | None = None
    nnodes: str | None = None  # "N" or "MIN:MAX"
    nproc: int | None = None
    overwrite: bool = False
    force: bool = False
    grace_s: float = 120.0

    def check(self) -> None:
        """ConfigError naming the flag for any value that cannot work."""
        at_least("--max-restarts", self.max_restarts, 0)
        at_least("--nproc-per-node", self.nproc, 1)
        if not self.grace_s > 0:
            raise ConfigError("--grace", f"must be more than 0 seconds (got {self.grace_s})")
        if self.resume is not None and not self.resume.strip():
            raise ConfigError("--resume", "is empty: give 'auto' or a checkpoint folder")
        if self.overwrite and self.resume == "auto":
            raise ConfigError("--overwrite", "cannot be combined with --resume auto (it would delete what "
                              "auto resumes from)")
        low, high = self.node_range
        if high > 1 or low > 1:
            rendezvous_endpoint()

    @property
    def node_range(self) -> tuple[int, int]:
        return parse_nnodes(self.nnodes)

    @property
    def elastic(self) -> bool:
        low, high = self.node_range
        return low != high or self.nproc is not None


def parse_nnodes(text: str | None) -> tuple[int, int]:
    """'--nnodes' as (min, max): 'N' is N:N."""
    if text is None:
        return 1, 1
    parts = text.split(":")
    try:
        low, high = (int(parts[0]), int(parts[-1])) if len(parts) <= 2 else (0, 0)
    except ValueError:
        raise ConfigError("--nnodes", f"'{text}' is not N or MIN:MAX (whole numbers)") from None
    if len(parts) > 2 or low < 1 or high < low:
        raise ConfigError("--nnodes", f"'{text}' must be N or MIN:MAX with 1 <= MIN <= MAX")
    return low, high


def rendezvous_endpoint() -> str:
    """TESSEL_RDZV_ENDPOINT, which every node of a multi-node run shares (host:port)."""
    endpoint = os.environ.get(RDZV_ENV, "")
    host, _, port = endpoint.rpartition(":")
    if not endpoint:
        raise ConfigError("--nnodes", f"more than one node needs a rendezvous endpoint: set {RDZV_ENV}=host:port "
                          "(the same on every node)")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(RDZV_ENV, f"'{endpoint}' is not host:port")
    return endpoint


# ---- checks before spawning --------------------------------------------------------------------
def ranks_per_node(cfg: Config, opts: LaunchOptions) -> int:
    """Ranks this launch starts on each node; a count the layout cannot take is refused here.

    With --nproc-per-node or an elastic --nnodes range the ranks re-plan dp for the world they
    find (runtime.elastic; tessel.elastic.dp_only); here the smallest world is checked."""
    low, _ = opts.node_range
    world = cfg.parallel.world_size
    nproc = opts.nproc or cfg.runtime.nproc_per_node or world // low
    if not opts.elastic and nproc * low != world:
        raise ConfigError("--nnodes", f"the layout's {world} ranks do not split evenly over {low} nodes")
    if opts.elastic:
        try:
            replan(cfg, nproc * low)
        except ConfigError as err:  # the layout cannot take that many ranks: the flag asked for them
            raise ConfigError("--nproc-per-node" if opts.nproc else "--nnodes",
                              f"{nproc * low} ranks do not fit the layout: {err}") from None
    return nproc


def check_devices(cfg: Config, nproc: int) -> None:
    r = cfg.runtime
    if r.device == "auto" and r.backend != "nccl":
        _say_auto_device(nproc)
        return
    if r.device != "cuda" and r.backend != "nccl":
        return
    import torch
    field = "runtime.device" if r.device == "cuda" else "runtime.backend"
    if not torch.cuda.is_available():
        raise ConfigError(field, f"asks for {'cuda' if r.device == 'cuda' else 'nccl'}, but this machine has no "
                          "usable GPU (torch.cuda.is_available() is False); use 'auto' or 'cpu'/'gloo'")
    if torch.cuda.device_count() < nproc:
        raise ConfigError(field, f"{nproc} ranks per node need {nproc} GPUs; this machine has "
                          f"{torch.cuda.device_count()}")


def _say_auto_device(nproc: int) -> None:
    """runtime.device = "auto" on a node with GPUs, but fewer than its ranks: one line saying the run
    takes the CPU (tessel.runtime.auto_uses_cuda), so that nobody mistakes it for a GPU run."""
    import torch
    from tessel.runtime import auto_uses_cuda  # deferred: loads torch
    if torch.cuda.is_available() and not auto_uses_cuda(nproc):
        print(f"[tessel] runtime.device = 'auto': {nproc} ranks per node but {torch.cuda.device_count()} GPU(s) "
              "here, so the ranks run on the CPU (gloo); set runtime.device = 'cuda' with one GPU per rank",
              file=sys.stderr, flush=True)


def check_environment(cfg: Config) -> None:
    """Inputs that reach the ranks outside the recipe: the topology file and TESSEL_FAULT."""
    from tessel.train.fault.injection import parse_faults  # deferred: loads torch (tessel.heartbeat)
    if cfg.runtime.topology is not None:
        try:
            Topology.load(cfg.runtime.topology)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ConfigError("runtime.topology", f"{cfg.runtime.topology} is not a topology file from "
                              f"`tessel probe` ({err})") from None
    try:
        parse_faults(os.environ.get("TESSEL_FAULT"))
    except ValueError as err:
        raise ConfigError("TESSEL_FAULT", str(err).removeprefix("TESSEL_FAULT: ")) from None


def check_resume(cfg: Config) -> int | None:
    """The step an explicit --resume PATH continues from (checked whole: files, model, shapes)."""
    from tessel.train.checkpoint.manager import CheckpointError, check_resume_target  # deferred: loads torch
    if cfg.checkpoint.resume in (None, "auto"):
        return None
    try:
        return int(check_resume_target(Path(cfg.checkpoint.resume), cfg)["step"])
    except CheckpointError as err:
        raise ConfigError("--resume", str(err)) from None


def with_resume(cfg: Config, resume: str | None) -> Config:
    """--resume as checkpoint.resume: set as a value (a path is never pasted into TOML), then the
    rules that involve it checked again."""
    if resume is not None:
        cfg.checkpoint.resume = resume
        check_layout(cfg)
    return cfg


@dataclass
class Preflight:
    """What the checks found: the config the ranks run, ranks per node, an explicit resume's step."""
    cfg: Config
    nproc: int
    resume_step: int | None


def preflight(cfg: Config, opts: LaunchOptions) -> Preflight:
    """Every check that needs no process: the flags, the world, devices, data, memory, the checkpoint."""
    from tessel.calibrate.device import check_memory  # deferred: the cost model, ~20 ms a bad recipe skips
    from tessel.models.build import check_init_from  # deferred: loads torch (the model on the meta device)
    from tessel.train.data import validate_data  # deferred: loads torch, after the checks that need none
    opts.check()
    cfg = with_resume(cfg, opts.resume)
    cfg.runtime.elastic = cfg.runtime.elastic or opts.elastic
    check_installed(cfg)  # logging.trackers' packages (optional extras)
    nproc = ranks_per_node(cfg, opts)
    check_devices(cfg, nproc)
    check_environment(cfg)
    validate_data(cfg)
    check_init_from(cfg.model)  # the weights' names and shapes against the model, from their headers
    check_memory(cfg, nproc, force=opts.force)
    return Preflight(cfg, nproc, check_resume(cfg))


# ---- the launcher --------------------------------------------------------------------------------
def torchrun_command(cfg: Config, opts: LaunchOptions, nproc: int, rank_args: list[str]) -> list[str]:
    """`python -m torch.distributed.run` with one process per rank: standalone on one node, c10d
    rendezvous on TESSEL_RDZV_ENDPOINT for many nodes or an elastic range (tessel.elastic.dp_only)."""
    low, high = opts.node_range
    if low == high == 1 and not opts.nnodes:
        rdzv = ["--standalone", "--nnodes=1"]
    else:
        rdzv = rendezvous_args(opts.nnodes)
    return [sys.executable, "-m", "torch.distributed.run", *rdzv, f"--nproc-per-node={nproc}",
            f"--max-restarts={opts.max_restarts}", *shutdown_args(int(opts.grace_s)), "-m", "tessel", *rank_args]


def launch(checked: Preflight, opts: LaunchOptions, say=print) -> int:
    """Claim out_dir, then run torchrun under supervision; the run's exit code."""
    from tessel.train.run_dir import claim  # deferred: loads torch (checkpoints); see the module's note
    cfg, nproc = checked.cfg, checked.nproc
    claimed = claim(cfg, resume=cfg.checkpoint.resume is not None, overwrite=opts.overwrite, say=say)
    control = ControlDir.create()
    try:
        if finished_already(cfg, claimed.run_id, checked.resume_step, say):
            return 0
        control.config_path.write_text(cfg.model_dump_json())
        env = rank_environment(cfg, os.environ)
        env.update({"TESSEL_CONTROL_DIR": str(control.path), "TESSEL_RUN_ID": claimed.run_id})
        _prepare_data(cfg)  # build the corpus cache once, not once per rank
        cmd = torchrun_command(cfg, opts, nproc, ["_rank", str(control.config_path)])
        return Supervisor(cmd, env, control, opts.grace_s).run()
    finally:
        control.remove()
        claimed.release()


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


def _prepare_data(cfg: Config) -> None:
    from tessel.train.data import load_tokens  # deferred: loads torch
    load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)


# ---- one rank ------------------------------------------------------------------------------------
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
