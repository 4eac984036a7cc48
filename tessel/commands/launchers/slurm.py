"""`tessel launch slurm`: an sbatch script that runs a recipe on N nodes, survives preemption and time limits.

The script asks for N nodes with one task each; `srun` starts one torchrun per
node (tessel.commands.launchers.job), all joining a c10d rendezvous on the first node's
address (Slurm's NodeAddr for it) on a port derived from the job id. Every rank
runs `tessel train RECIPE --resume auto`.

Stopping and coming back (tessel.train.fault.preempt does the saving):
- Preemption, `scontrol requeue`, a node failure: Slurm sends SIGTERM to every
  process of the job and SIGKILL KillWait (or the partition's GraceTime)
  seconds later. Each rank finishes its step, all agree to stop, and a
  preemption checkpoint is written. `--requeue` puts the job back in the queue,
  and the next attempt resumes from that checkpoint.
- The time limit (`--time`): `--signal=B:USR1@GRACE` wakes this script GRACE
  seconds before it; the script sends SIGTERM to the ranks (`scancel
  --signal=TERM`: the same checkpoint) and requeues the job itself. `scancel --batch --signal=USR1 JOB`
  does the same by hand.
- `scancel JOB` ends the job: the ranks still save, nothing is requeued.

Logs: the script's own (`%x-%j.out`) and one per node (`%x-%j-node%n.out`),
appended to by every attempt (`--open-mode=append`).
"""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from tessel.config import ConfigError
from tessel.commands.launchers.job import ClusterJob, torchrun_argv

# The rendezvous port: base + job id mod 1000, so that jobs sharing a first node rarely collide.
PORT_SPAN = 1000
_TIME = re.compile(r"^(?:(?P<d>\d+)-(?P<dh>\d+)(?::(?P<dm>\d+)(?::(?P<ds>\d+))?)?|(?P<a>\d+)(?::(?P<b>\d+)"
                   r"(?::(?P<c>\d+))?)?)$")


def time_limit_s(text: str) -> int | None:
    """Slurm's --time as seconds (None: unlimited); ConfigError naming --time for anything else.

    The forms sbatch takes: M, M:S, H:M:S, D-H, D-H:M, D-H:M:S, UNLIMITED/INFINITE."""
    if text.upper() in ("UNLIMITED", "INFINITE"):
        return None
    m = _TIME.match(text)
    if not m:
        raise ConfigError("--time", f"'{text}' is not a Slurm time: minutes, MM:SS, HH:MM:SS, D-HH, D-HH:MM or "
                          "D-HH:MM:SS")
    if m["d"] is not None:
        seconds = int(m["d"]) * 86400 + int(m["dh"]) * 3600 + int(m["dm"] or 0) * 60 + int(m["ds"] or 0)
    elif m["c"] is not None:
        seconds = int(m["a"]) * 3600 + int(m["b"]) * 60 + int(m["c"])
    else:
        seconds = int(m["a"]) * 60 + int(m["b"] or 0)
    if seconds <= 0:
        raise ConfigError("--time", f"'{text}' is no time at all")
    return seconds


@dataclass
class SlurmOptions:
    """sbatch's settings beyond the job's shape."""
    job_name: str = "tessel"
    partition: str | None = None
    time: str | None = None
    account: str | None = None
    cpus_per_task: int | None = None  # default: the node's ranks x runtime.threads_per_rank on a CPU cluster
    port: int = 29500  # the rendezvous port's base (see PORT_SPAN)
    requeue: bool = True
    extra: list[str] = field(default_factory=list)  # more #SBATCH lines, as sbatch flags: --qos=high

    def check(self, grace_s: int) -> None:
        if not re.fullmatch(r"[A-Za-z0-9._-]+", self.job_name):
            raise ConfigError("--job-name", f"'{self.job_name}' must be letters, digits, '.', '_' or '-'")
        for flag, value in (("--partition", self.partition), ("--account", self.account)):
            if value is not None and not re.fullmatch(r"[A-Za-z0-9._,-]+", value):
                raise ConfigError(flag, f"'{value}' is not a Slurm name")
        if self.cpus_per_task is not None and self.cpus_per_task < 1:
            raise ConfigError("--cpus-per-task", f"must be at least 1 (got {self.cpus_per_task})")
        if not 1024 <= self.port <= 65535 - PORT_SPAN:
            raise ConfigError("--port", f"must be 1024..{65535 - PORT_SPAN} (got {self.port}): the job adds its "
                              f"id mod {PORT_SPAN}")
        for arg in self.extra:
            if not arg.startswith("--") or "\n" in arg:
                raise ConfigError("--sbatch-arg", f"'{arg}' is not one sbatch flag (--name=value)")
        limit = time_limit_s(self.time) if self.time is not None else None
        if limit is not None and grace_s > 65535:  # sbatch --signal's own bound
            raise ConfigError("--grace", f"{grace_s} s is more than sbatch's --signal takes (65535 s)")
        if limit is not None and limit <= grace_s:
            raise ConfigError("--grace", f"{grace_s} s is not shorter than --time {self.time} ({limit} s): the "
                              "run would be told to stop before it started")


def sbatch_script(job: ClusterJob, opts: SlurmOptions, recipe: Path, log_dir: Path, workdir: Path) -> str:
    """The sbatch script (see the module docstring)."""
    cfg = job.cfg
    cpus = opts.cpus_per_task or (None if job.gpus else job.per_node * cfg.runtime.threads_per_rank)
    directives = [f"--job-name={opts.job_name}", f"--nodes={job.nodes}", "--ntasks-per-node=1"]
    if job.gpus:
        directives.append(f"--gpus-per-node={job.per_node}")
    if cpus:
        directives.append(f"--cpus-per-task={cpus}")
    directives += [f"--{k}={v}" for k, v in (("partition", opts.partition), ("account", opts.account),
                                              ("time", opts.time)) if v is not None]
    if opts.requeue:
        directives.append("--requeue")
    timed = opts.time is not None and time_limit_s(opts.time) is not None
    if timed:
        directives.append(f"--signal=B:USR1@{job.grace_s}")
    directives += ["--open-mode=append", f"--output={log_dir}/%x-%j.out", f"--chdir={workdir}", *opts.extra]
    # placeholders shlex leaves unquoted, filled by the shell at run time: the first node's address, the job id
    node = torchrun_argv(job, str(recipe), "@ENDPOINT@", "@JOB@")
    node_line = _wrapped([shlex.quote(a) for a in node]).replace("@ENDPOINT@", "$rdzv_endpoint").replace(
        "@JOB@", "$SLURM_JOB_ID")
    srun = (f"srun --nodes={job.nodes} --ntasks-per-node=1 --kill-on-bad-exit=1 --open-mode=append "
            f"--output={shlex.quote(str(log_dir))}/%x-%j-node%n.out \\\n    {node_line} &")
    return _TEMPLATE.format(
        nodes=job.nodes, per_node=job.per_node, world=job.world, what="GPUs" if job.gpus else "CPU ranks",
        directives="\n".join(f"#SBATCH {d}" for d in directives), port=opts.port, span=PORT_SPAN,
        threads=cfg.runtime.threads_per_rank, srun=srun,
        requeue_self=_REQUEUE_SELF.replace("GRACE", str(job.grace_s)) if timed and opts.requeue else "")


def _wrapped(words: list[str], width: int = 100) -> str:
    """Shell words over continuation lines of at most `width` characters."""
    lines, line = [], ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            lines.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    return " \\\n      ".join([*lines, line])


_TEMPLATE = """#!/bin/bash
# Written by `tessel launch slurm`: {nodes} nodes x {per_node} {what} = {world} ranks, one torchrun per node.
# Submit with sbatch. A preempted or requeued attempt saves a checkpoint on SIGTERM and the next one resumes
# from it (--resume auto); see tessel/commands/launchers/slurm.py.
{directives}
set -u
# the rendezvous: the first node's address as Slurm knows it (NodeAddr), a port from the job id
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
rdzv_host=$(scontrol show node "$head_node" -o | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
rdzv_endpoint="${{rdzv_host:-$head_node}}:$(({port} + SLURM_JOB_ID % {span}))"
export OMP_NUM_THREADS={threads} PYTHONUNBUFFERED=1
echo "[tessel] job $SLURM_JOB_ID attempt $((${{SLURM_RESTART_COUNT:-0}} + 1)) on $SLURM_JOB_NODELIST," \\
     "rendezvous $rdzv_endpoint, $(date '+%F %T')"

stopping=""
trapped=""
on_term() {{  # Slurm is ending the job (preemption, requeue, scancel): the ranks got SIGTERM too and save
  stopping=term trapped=1
}}
trap on_term TERM
{requeue_self}
{srun}
srun_pid=$!
code=0
while :; do  # a trapped signal ends `wait` early: wait again until srun itself has ended
  trapped=""
  wait "$srun_pid"; status=$?
  [ "$status" -eq 127 ] && break  # already reported (a signal came just after srun ended)
  code=$status
  [ -z "$trapped" ] && break
done
echo "[tessel] the ranks exited with $code, $(date '+%F %T')"
if [ "$stopping" = time ] && [ "$code" -ne 0 ]; then
  scontrol requeue "$SLURM_JOB_ID"  # the next attempt resumes from the checkpoint just written
fi
exit "$code"
"""

_REQUEUE_SELF = """on_time_limit() {  # --signal: the time limit is near: checkpoint now, continue in a new attempt
  stopping=time trapped=1
  echo "[tessel] time limit in GRACE s or less: stopping the ranks for a checkpoint, then requeueing"
  # SIGTERM to every process of the job's steps, not to this script (srun itself would SIGKILL its tasks)
  scancel --signal=TERM "$SLURM_JOB_ID"  # each rank saves after its step
}
trap on_time_limit USR1
"""


def write(job: ClusterJob, opts: SlurmOptions, script: Path, workdir: Path) -> Path:
    """Write the frozen recipe and the script beside each other, and the logs folder; the script's path."""
    script.parent.mkdir(parents=True, exist_ok=True)
    recipe = script.with_suffix(".toml")
    recipe.write_text(job.recipe_toml())
    log_dir = script.parent / "logs"
    log_dir.mkdir(exist_ok=True)
    text = sbatch_script(job, opts, recipe.resolve(), log_dir.resolve(), workdir.resolve())
    script.write_text(text)
    script.chmod(0o755)
    return script


def check_sbatch() -> str:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise ConfigError("--submit", "sbatch is not on PATH: run this on a Slurm login node, or write the script "
                          "without --submit and submit it there")
    return sbatch


def submit(script: Path) -> str:
    """sbatch the script; the job id."""
    done = subprocess.run([check_sbatch(), "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if done.returncode:
        raise ConfigError("--submit", f"sbatch refused {script}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout.strip().split(";")[0]
