"""A real Slurm on this machine for tests: munged, slurmctld and two slurmd ("nodes" tn1, tn2), all private.

Debian's `slurm-wlm` and `munge` (`.ci/run` installs them) provide the daemons;
nothing of the system's Slurm or munge setup is used or changed: the key, the
munge socket, the configuration, the state and the logs live in a temporary
folder, the ports are free ones, and every daemon runs in the foreground as our
child. Two slurmd on one host (Slurm's multiple-slurmd build, as Debian's is)
give a job of 2 nodes, each with its own NodeName and port, both at 127.0.0.1.

`stop()` cancels the jobs, ends the daemons and then every process that carries
this cluster's SLURM_CONF in its environment (slurmstepd and the job's own,
which inherit it), so nothing is left running.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "squeue", "srun")


def why_not() -> str | None:
    """None when a private Slurm can start here, else the reason (the test's skip reason)."""
    apt = os.environ.get("TESSEL_SLURM_APT_FAILED")  # set by .ci/run when apt-get could not install them
    missing = [tool for tool in DAEMONS if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists()]
    if missing:
        why = f"Slurm is not installed ({', '.join(missing)} missing; Debian: apt-get install slurm-wlm munge)"
        return f"{why}; .ci/run tried: {apt}" if apt else why
    if os.geteuid() != 0:
        return "a private Slurm needs root (slurmd runs jobs as their user; SlurmUser=root here)"
    return None


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    """`with LocalSlurm(nodes=2) as slurm: slurm.run("sbatch", ...)`."""

    def __init__(self, nodes: int = 2, cpus_per_node: int = 2, kill_wait_s: int = 60):
        self.nodes = [f"tn{k + 1}" for k in range(nodes)]
        self.cpus, self.kill_wait_s = cpus_per_node, kill_wait_s
        self.dir = Path(tempfile.mkdtemp(prefix="tessel-slurm-"))
        self.dir.chmod(0o755)  # munged wants every folder above its socket reachable by everyone
        self.conf = self.dir / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs: list[subprocess.Popen] = []

    def __enter__(self) -> "LocalSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        munge = self.dir / "munge"
        munge.mkdir(mode=0o755)
        subprocess.run([_tool("mungekey"), "-c", "-k", str(munge / "key")], check=True, capture_output=True)
        self._daemon(_tool("munged"), "-F", f"--socket={munge / 'sock'}", f"--key-file={munge / 'key'}",
                     f"--log-file={munge / 'log'}", f"--pid-file={munge / 'pid'}", f"--seed-file={munge / 'seed'}")
        self._wait_for(lambda: (munge / "sock").exists(), "munged's socket")
        ctld, *node_ports = _free_ports(1 + len(self.nodes))
        self.conf.write_text(self._config(munge / "sock", ctld, node_ports))
        for sub in ("state", "log", *(f"spool/{n}" for n in self.nodes)):
            (self.dir / sub).mkdir(parents=True)
        self._daemon(_tool("slurmctld"), "-D", "-f", str(self.conf))
        for node in self.nodes:
            self._daemon(_tool("slurmd"), "-D", "-f", str(self.conf), "-N", node)
        self._wait_for(self._nodes_idle, "both slurmd to register as idle")

    def _config(self, munge_socket: Path, ctld_port: int, node_ports: list[int]) -> str:
        host = socket.gethostname().split(".")[0]
        lines = [
            "ClusterName=tesseltest", f"SlurmctldHost={host}(127.0.0.1)", f"SlurmctldPort={ctld_port}",
            "SlurmUser=root", "SlurmdUser=root", "AuthType=auth/munge", f"AuthInfo=socket={munge_socket}",
            "CredType=cred/munge", f"StateSaveLocation={self.dir / 'state'}", f"SlurmdSpoolDir={self.dir}/spool/%n",
            f"SlurmctldPidFile={self.dir}/slurmctld.pid", f"SlurmdPidFile={self.dir}/slurmd-%n.pid",
            f"SlurmctldLogFile={self.dir}/log/slurmctld.log", f"SlurmdLogFile={self.dir}/log/slurmd-%n.log",
            # no cgroups here: processes tracked by their parentage, tasks not bound
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "MpiDefault=none", "ReturnToService=2", "SchedulerType=sched/builtin",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "SwitchType=switch/none",
            f"KillWait={self.kill_wait_s}",  # SIGTERM to SIGKILL on a requeue or cancel: time to save
            "SlurmdParameters=config_overrides",  # two slurmd share this machine's cores
        ]
        for node, port in zip(self.nodes, node_ports):
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} "
                         "RealMemory=2000")
        lines.append(f"PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _daemon(self, *argv: str) -> None:
        log = open(self.dir / f"{Path(argv[0]).name}-{len(self.procs)}.out", "w")
        self.procs.append(subprocess.Popen(list(argv), env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        log.close()

    def _wait_for(self, ready, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0]} exited while waiting for {what}:\n{self.logs()}")
            if ready():
                return
            time.sleep(0.2)
        raise TimeoutError(f"no {what} within {timeout:.0f} s:\n{self.logs()}")

    def _nodes_idle(self) -> bool:
        done = self.run("sinfo", "-h", "-o", "%T", check=False)
        states = done.stdout.split()
        return done.returncode == 0 and len(states) > 0 and all(s == "idle" for s in states)

    def run(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm client command against this cluster."""
        return subprocess.run(list(argv), env=self.env, capture_output=True, text=True, timeout=60, check=check)

    def job_state(self, job: str) -> tuple[str, str]:
        """(state, reason) from scontrol, e.g. ("PENDING", "BeginTime")."""
        out = self.run("scontrol", "show", "job", job, "-o").stdout
        fields = dict(f.split("=", 1) for f in out.split() if "=" in f)
        return fields.get("JobState", ""), fields.get("Reason", "")

    def wait_state(self, job: str, states: set[str], timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state, _ = self.job_state(job)
            if state in states:
                return state
            time.sleep(0.2)
        raise TimeoutError(f"job {job} is {state}, not {states}, after {timeout:.0f} s:\n{self.logs()}")

    def release(self, job: str) -> None:
        """Start a requeued job now rather than after Slurm's two-minute BeginTime.

        That delay lets the nodes finish with the attempt before: a relaunch whose credential is not
        newer (to the second) than the revocation of the old one is refused ("Job credential revoked")
        and the job fails. So: wait for both nodes to be idle again, then a second more."""
        self._wait_for(self._nodes_idle, "the nodes to finish the job's last attempt")
        time.sleep(1.5)
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")

    def logs(self) -> str:
        files = [*self.dir.glob("*.out"), self.dir / "munge" / "log", *sorted((self.dir / "log").glob("*.log"))]
        return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}" for f in files if f.is_file())

    def ours(self) -> list[int]:
        """Every live process that carries this cluster's SLURM_CONF (daemons, slurmstepd, jobs)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                if marker in (proc / "environ").read_bytes().split(b"\0"):
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    def stop(self) -> None:
        if self.conf.exists() and any(p.poll() is None for p in self.procs):
            self.run("scancel", "--full", "--signal=KILL", "--user=root", check=False)
        for p in reversed(self.procs):  # slurmd before slurmctld before munged
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)
        for _ in range(50):  # what the daemons started and left (a slurmstepd, a rank)
            left = self.ours()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        self.procs.clear()
        shutil.rmtree(self.dir, ignore_errors=True)
