"""Launching `tessel train`: every check before any process, then torchrun under supervision.

The launcher (no torchrun in the environment) checks everything a user can get
wrong before a single rank exists (exit 2, one line naming the field), claims
the output folder, then runs torchrun under a tessel.commands.supervise.Supervisor with
one process per rank. Ranks start as `python -m tessel _rank CONFIG` (tessel.elastic.rank), reading
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
import uuid
from dataclasses import dataclass
from pathlib import Path

from tessel.comm.topology import Topology
from tessel.commands.supervise import Supervisor
from tessel.config import Config, ConfigError, at_least, check_layout
from tessel.elastic.dp_only import replan
from tessel.elastic.rank import finished_already, rank_environment
from tessel.observe.trackers import check_installed
from tessel.train.fault.preempt import ControlDir

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
        if cfg.train.precision == "fp8":  # the GPUs "auto" takes, if it takes them, must multiply in float8
            from tessel.runtime import auto_uses_cuda  # deferred: loads torch
            if auto_uses_cuda(nproc):
                _check_float8(cfg)
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
    _check_float8(cfg)


def _check_float8(cfg: Config) -> None:
    """train.precision = "fp8" on a GPU without float8 matmuls: refused here, naming the GPU (the CPU emulates)."""
    if cfg.train.precision != "fp8":
        return
    from tessel.parallel.float8.device import float8_refusal  # deferred: loads torch
    refusal = float8_refusal()
    if refusal:
        raise ConfigError("train.precision", refusal)


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


def shutdown_args(grace_s: int) -> list[str]:
    """torchrun's wait between forwarding a stop signal to the ranks and killing them: the grace a
    signalled run gets to finish its step and save. torch 2.13's torchrun has the flag, 2.11's refuses
    it (a GPU machine's own torch build may be older than this project's pin), so it is passed only where
    torchrun takes it; an older one keeps its own default, and tessel's supervisor still waits the whole
    grace before it kills."""
    from torch.distributed.run import get_args_parser  # deferred: loads torch
    flag = f"--shutdown-timeout={grace_s}"
    _, unknown = get_args_parser().parse_known_args([flag, "script.py"])
    return [] if unknown else [flag]


def rendezvous_args(nnodes: str) -> list[str]:
    """torchrun arguments for an elastic node range. One machine by default; TESSEL_RDZV_ENDPOINT
    (host:port, the same on every node) and TESSEL_RDZV_ID join several machines."""
    from tessel.spawn import free_port  # deferred: loads torch; the launcher imports this module before torch
    endpoint = os.environ.get("TESSEL_RDZV_ENDPOINT") or f"localhost:{free_port()}"
    run_id = os.environ.get("TESSEL_RDZV_ID") or uuid.uuid4().hex[:12]
    # once MIN nodes are in, wait only briefly for more before starting
    return [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={run_id}",
            "--rdzv-conf=last_call_timeout=5"]


def _prepare_data(cfg: Config) -> None:
    from tessel.train.data import load_tokens  # deferred: loads torch
    load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
