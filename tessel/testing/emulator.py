"""A multi-node cluster on one machine: network namespaces, veth links, a bridge, tc shaping.

    with Emulator(nodes=2, nproc_per_node=2, rate="1gbit") as emu:
        results = emu.run(["-m", "tessel", "probe", "--out", "topo.json"])

Each "node" is a network namespace with one interface (eth0, 10.77.0.(10+k)/24)
whose veth peer sits on a bridge in a separate "switch" namespace, so nothing
in the host's own network changes and no outside address is reachable.
Traffic between ranks of one node stays on that namespace's loopback
(unshaped); traffic between nodes crosses two veths, each shaped on egress by
`tc` tbf (token bucket: the kernel here has no netem, so there is rate but no
added delay). One torchrun per node joins a c10d rendezvous hosted by node 0.

Shaping (each inter-node direction crosses two tbf qdiscs in series, node
egress and switch port, both with the same settings):
- rate 1gbit: the line rate (tc's SI units: 10^9 bit/s, counted on whole
  Ethernet frames, so TCP payload tops out near 96% of it);
- burst 256 KiB (~2 ms at 1 Gbit/s): on a loaded machine the qdisc watchdog
  wakes late, and tokens beyond the bucket are lost, so a bucket of a timer
  slack or two keeps the rate; it lets at most 256 KiB through at once after
  an idle spell (<2% of a 16 MiB all-reduce, for any algorithm alike);
- latency 50ms: the queue bound (limit = rate x latency + burst, ~6.5 MB),
  a deep switch buffer. Measured during the all-reduce benchmark under this
  host's BBR congestion control (the namespaces inherit it): no drops,
  backlog under 0.6 MB, TCP round trips 2-12 ms, because BBR paces to the
  bottleneck rather than filling the queue. So the bound never bites.
- congestion (default None: the host's): TCP congestion control inside the
  nodes, for runs that must not depend on the host's setting. It matters when
  two flows share an uplink (hierarchical all-reduce: one per local rank).
  BBR split one uplink 3:1 between them, and the flow left alone at the end
  took tens of ms to pace back up to the line rate; under reno both finished
  together. But reno fills the 50 ms queue, which slows the flat ring, whose
  steps wait on each other across the slow links (16 MiB: ring 227 ms vs 214-225
  under BBR); with latency 10ms that is gone, and the ring/hierarchical ratio
  is the same as under BBR (1.44x, ring 217 ms, hierarchical 150 ms).

Cleanup always runs (context exit, atexit, SIGTERM): every process group we
started is killed, then the namespaces are deleted (which deletes their veths
and the bridge). `cleanup_stale()` removes leftovers of emulators whose owner
process is gone. Needs root (CAP_NET_ADMIN); `require_root()` explains.
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PREFIX = "tslemu"
SUBNET = "10.77.0"  # private, and only inside our own namespaces
RDZV_PORT = 29477
_counter = itertools.count()


def require_root() -> str | None:
    """None when the emulator can run here, else the reason it cannot."""
    if os.geteuid() != 0:
        return "the multi-node emulator needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"the multi-node emulator needs the `{tool}` command (iproute2)"
    return None


def _sh(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), check=check, capture_output=True, text=True, timeout=30)


@dataclass
class NodeRun:
    node: int
    returncode: int
    log: str


@dataclass
class Emulator:
    nodes: int = 2
    nproc_per_node: int = 2
    rate: str | None = "1gbit"  # tbf rate of every inter-node link direction; None: unshaped
    burst: str = "256kb"  # token bucket depth: >= rate / HZ, small next to the messages measured
    queue_latency: str = "50ms"  # tbf queue bound (drops past it, as a switch buffer would)
    congestion: str | None = None  # TCP congestion control inside the nodes (e.g. "reno"); None: the host's
    # an elastic job: torchrun's --nnodes MIN:MAX (None: all `nodes`), restarts per node, and how soon a lost
    # node's rendezvous entry expires (keep-alive period in seconds x 3 missed beats)
    min_nodes: int | None = None
    max_restarts: int = 0
    keep_alive_s: int = 5
    name: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}x{next(_counter)}")
    _made: list[str] = field(default_factory=list, repr=False)
    _procs: list[subprocess.Popen] = field(default_factory=list, repr=False)
    _lost: set[int] = field(default_factory=set, repr=False)  # nodes kill_node took down
    _old_term: object = field(default=None, repr=False)  # the SIGTERM handler to restore on cleanup

    # ---- names --------------------------------------------------------------
    def ns(self, k: int) -> str:
        return f"{self.name}n{k}"

    @property
    def switch(self) -> str:
        return f"{self.name}sw"

    def ip(self, k: int) -> str:
        return f"{SUBNET}.{10 + k}"

    # ---- lifecycle ----------------------------------------------------------
    def __enter__(self) -> "Emulator":
        why = require_root()
        if why:
            raise PermissionError(why)
        atexit.register(self.cleanup)
        self._old_term = signal.signal(signal.SIGTERM, self._on_term)
        try:
            self._build()
        except BaseException:
            self.cleanup()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()

    def _on_term(self, signum, frame):
        self.cleanup()
        raise SystemExit(128 + signum)

    def _netns(self, ns: str, *args: str) -> None:
        _sh("ip", "netns", "exec", ns, *args)

    def _build(self) -> None:
        _sh("ip", "netns", "add", self.switch)
        self._made.append(self.switch)
        self._netns(self.switch, "ip", "link", "add", "br0", "type", "bridge")
        self._netns(self.switch, "ip", "link", "set", "br0", "up")
        for k in range(self.nodes):
            ns, tmp_node, tmp_sw = self.ns(k), f"tsa{os.getpid() % 100000}{k}", f"tsb{os.getpid() % 100000}{k}"
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            _sh("ip", "link", "add", tmp_node, "type", "veth", "peer", "name", tmp_sw)
            _sh("ip", "link", "set", tmp_node, "netns", ns)
            _sh("ip", "link", "set", tmp_sw, "netns", self.switch)
            self._netns(ns, "ip", "link", "set", tmp_node, "name", "eth0")
            self._netns(self.switch, "ip", "link", "set", tmp_sw, "name", f"p{k}")
            self._netns(ns, "ip", "addr", "add", f"{self.ip(k)}/24", "dev", "eth0")
            if self.congestion:
                self._set_congestion(ns)
            for cmd in (("lo",), ("eth0",)):
                self._netns(ns, "ip", "link", "set", cmd[0], "up")
            self._netns(self.switch, "ip", "link", "set", f"p{k}", "master", "br0")
            self._netns(self.switch, "ip", "link", "set", f"p{k}", "up")
            if self.rate:  # both directions: node egress, and the switch port towards the node
                for where, dev in ((ns, "eth0"), (self.switch, f"p{k}")):
                    self._netns(where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                                "burst", self.burst, "latency", self.queue_latency)

    def _set_congestion(self, ns: str) -> None:
        res = _sh("ip", "netns", "exec", ns, "sysctl", "-qw", f"net.ipv4.tcp_congestion_control={self.congestion}",
                  check=False)
        if res.returncode:
            allowed = _sh("ip", "netns", "exec", ns, "cat", "/proc/sys/net/ipv4/tcp_allowed_congestion_control",
                          check=False).stdout.strip()
            raise ValueError(f"Emulator.congestion={self.congestion!r} is not usable in a network namespace here "
                             f"(allowed: {allowed or 'unknown'}; the host's net.ipv4.tcp_allowed_congestion_control "
                             f"decides); pick one of those or None for the host's default")

    def cleanup(self) -> None:
        """Kill what we started, delete what we made. Safe to call twice."""
        for p in self._procs:
            _kill_group(p)
        self._procs.clear()
        for ns in reversed(self._made):
            _kill_ns_pids(ns)
            _sh("ip", "netns", "del", ns, check=False)
        self._made.clear()
        if self._old_term is not None:
            signal.signal(signal.SIGTERM, self._old_term)
            self._old_term = None

    # ---- running torchrun on every node -------------------------------------
    def torchrun_cmd(self, k: int, argv: list[str], run_id: str) -> list[str]:
        nnodes = f"{self.min_nodes}:{self.nodes}" if self.min_nodes is not None else str(self.nodes)
        elastic = (f",last_call_timeout=3,keep_alive_interval={self.keep_alive_s},keep_alive_max_attempt=3"
                   if self.min_nodes is not None else "")
        return [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}",
                f"--nproc-per-node={self.nproc_per_node}", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.ip(0)}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                f"--rdzv-conf=is_host={'true' if k == 0 else 'false'},join_timeout=120{elastic}",
                f"--local-addr={self.ip(k)}", f"--max-restarts={self.max_restarts}", *argv]

    def kill_node(self, k: int) -> None:
        """Node k is lost: every process in its namespace, its torchrun agent too, dies at once (SIGKILL),
        as when a machine goes down: no agent is left to close the rendezvous, so an elastic job's other
        nodes restart without it."""
        self._lost.add(k)
        _kill_ns_pids(self.ns(k))

    def run(self, argv: list[str], timeout: float = 300.0, env: dict[str, str] | None = None,
            watch: Callable[["Emulator"], None] | None = None) -> list[NodeRun]:
        """Run `python -m torch.distributed.run ... <argv>` on every node; wait (bounded); return logs.

        Ranks see TESSEL_EMU_NODE (their node index: ground truth for tests) and
        GLOO_SOCKET_IFNAME=eth0 (gloo binds the namespace's own interface).
        `watch(emulator)` is called every poll while the nodes run (a drill: kill_node when something
        happened); a node it killed is not a failure that ends the wait.
        """
        run_id = uuid.uuid4().hex[:8]
        logdir = Path(tempfile.mkdtemp(prefix="tessel-emu-"))
        base = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "eth0", "PYTHONUNBUFFERED": "1",
                "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                             os.environ.get("PYTHONPATH")])),
                **(env or {})}
        logs = []
        try:
            for k in range(self.nodes):
                out = open(logdir / f"node{k}.log", "w")
                logs.append(out)
                cmd = ["ip", "netns", "exec", self.ns(k), *self.torchrun_cmd(k, argv, run_id)]
                self._procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                                    env={**base, "TESSEL_EMU_NODE": str(k)},
                                                    start_new_session=True))
            deadline = time.monotonic() + timeout
            while any(p.poll() is None for p in self._procs) and time.monotonic() < deadline:
                if any(p.poll() not in (None, 0) for k, p in enumerate(self._procs) if k not in self._lost):
                    break  # one node failed: do not wait for the others to time out
                if watch is not None:
                    watch(self)
                time.sleep(0.1)
            codes = [p.poll() for p in self._procs]
        finally:
            for p in self._procs:
                _kill_group(p)
            self._procs.clear()
            for f in logs:
                f.close()
        runs = [NodeRun(k, -9 if c is None else c, (logdir / f"node{k}.log").read_text())
                for k, c in enumerate(codes)]
        shutil.rmtree(logdir, ignore_errors=True)
        return runs


def _kill_group(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


def _kill_ns_pids(ns: str) -> None:
    """Anything still running inside one of our namespaces (a rank that escaped its group)."""
    res = _sh("ip", "netns", "pids", ns, check=False)
    for pid in res.stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def cleanup_stale() -> list[str]:
    """Delete namespaces of emulators whose owning process no longer exists."""
    res = _sh("ip", "netns", "list", check=False)
    removed = []
    for line in res.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        if not name.startswith(PREFIX):
            continue
        pid = name[len(PREFIX):].split("x")[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _kill_ns_pids(name)
            _sh("ip", "netns", "del", name, check=False)
            removed.append(name)
    return removed


def main(argv: list[str] | None = None) -> int:
    """python -m tessel.testing.emulator [--nodes 2] [--nproc-per-node 2] [--rate 1gbit] -- <torchrun args>"""
    ap = argparse.ArgumentParser(description=main.__doc__)
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--nproc-per-node", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="tbf rate of inter-node links; 'none' for unshaped")
    ap.add_argument("--congestion", default=None, help="TCP congestion control in the nodes (default: the host's)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("cmd", nargs=argparse.REMAINDER, help="what torchrun runs, e.g. -m tessel probe")
    args = ap.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    cleanup_stale()
    with Emulator(args.nodes, args.nproc_per_node, None if args.rate == "none" else args.rate,
                  congestion=args.congestion) as emu:
        runs = emu.run(cmd, timeout=args.timeout)
    for r in runs:
        print(f"===== node {r.node} (exit {r.returncode}) =====\n{r.log}")
    return max(abs(r.returncode) for r in runs)


if __name__ == "__main__":
    raise SystemExit(main())
