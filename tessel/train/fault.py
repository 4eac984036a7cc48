"""Hangs, stragglers, numerical faults, and deterministic fault injection.

- Heartbeat: a daemon thread per rank writes (beat, step, phase, pid, host) to
  the torch.distributed store every `heartbeat_s`. A watchdog thread on every
  rank reads all ranks' beats; a rank whose beat has not advanced for
  `hang_timeout_s` (a frozen or dead process: its heartbeat thread stops with
  it) is reported with what it was doing, and the group exits non-zero so
  torchrun's agent restarts it. The watchdog on the stalled rank's host also
  SIGKILLs it, since a stopped process ignores the agent's SIGTERM for 30 s.
  Collectives themselves time out after runtime.timeout_s (the backstop for a
  rank that is alive but stuck).
- Stragglers: every `straggler_every` steps the ranks all-gather the time of
  their local forward passes; a rank slower than `straggler_factor` x the
  median is named in a warning and in the `straggler_rank` metric.
- Numerical faults: a non-finite loss or gradient norm on any rank skips the
  step on every rank (one all-reduce of a flag); the caller rolls back after
  `nan_tolerance` skipped steps in a row.
- Injection: TESSEL_FAULT="kill:rank=2:step=5,stop:rank=1:step=3,nan:rank=0:step=4:count=3,
  slow:rank=1:step=2:seconds=0.3" fires each fault once across restarts (a
  marker file per fault in TESSEL_FAULT_DIR or the checkpoint directory).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

STALL_EXIT_CODE = 43


class FatalError(RuntimeError):
    """A deterministic failure that a restart would only repeat (disk full, a bad input found late).

    The rank reports it in one line, without a traceback, and the launcher does
    not restart the run (tessel.launch)."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---- numerical faults --------------------------------------------------------
def agree(loss: torch.Tensor, grad_norm: torch.Tensor, stop_signal: int, device: torch.device) -> tuple[bool, int]:
    """One all-reduce per step, so every rank takes the same decisions: (the loss and gradient norm
    are finite on every rank, the signal some rank was asked to stop on or 0)."""
    finite = bool(torch.isfinite(loss).all()) and bool(torch.isfinite(grad_norm).all())
    flags = torch.tensor([0.0 if finite else 1.0, float(stop_signal)], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    return flags[0].item() == 0.0, int(flags[1].item())


# ---- heartbeat and watchdog --------------------------------------------------
def _store_client(timeout_s: float):
    """A connection of our own to the rendezvous store (the threads must not share the trainer's)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    run = os.environ.get("TORCHELASTIC_RUN_ID", "spawn")
    return dist.PrefixStore(f"tessel-hb/{run}/{attempt}/", store)


class Heartbeat:
    """Per-rank beat writer plus a watchdog over every rank's beat."""

    def __init__(self, rank: int, world: int, heartbeat_s: float, hang_timeout_s: float,
                 kill_stalled: bool = True, on_stall=None):
        self.rank, self.world = rank, world
        self.period, self.timeout = heartbeat_s, hang_timeout_s
        self.kill_stalled = kill_stalled
        self.on_stall = on_stall or (lambda report: os._exit(STALL_EXIT_CODE))
        self.step, self.phase = -1, "init"
        self.beat = 0
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._wake = threading.Event()  # a phase change is written at once, not at the next period
        self.store = None
        self.threads = []

    def start(self, watch: bool = True) -> "Heartbeat":
        """Beat (and, with watch, judge every other rank's beat: the trainer's watchdog)."""
        if self.world == 1:
            return self
        self.store = _store_client(max(10.0, 4 * self.period))
        if self.store is None:
            return self
        self.threads = [threading.Thread(target=self._beat_loop, daemon=True, name="tessel-heartbeat")]
        if watch:
            self.threads.append(threading.Thread(target=self._watch_loop, daemon=True, name="tessel-watchdog"))
        for t in self.threads:
            t.start()
        return self

    def stop(self) -> None:
        """Say 'done' (a finished rank is not a stalled one), then stop both threads."""
        self._stop.set()
        self._wake.set()
        if self.threads:
            self.threads[0].join(timeout=2 * self.period + 1)  # no beat may land after 'done'
            self.phase = "done"
            try:
                self.store.set(f"rank{self.rank}", json.dumps({"beat": -1, "step": self.step, "phase": "done",
                                                               "pid": os.getpid(), "host": self.host}))
            except Exception:  # noqa: BLE001
                pass

    def set(self, step: int, phase: str, flush: bool = False) -> None:
        """Record what this rank does; flush=True writes it before returning (once per step)."""
        self.step, self.phase = step, phase
        if flush and self.threads:
            self._write()
        else:
            self._wake.set()

    def _write(self) -> None:
        with self._lock:  # the beat thread and the trainer share one store connection
            self.beat += 1
            doc = {"beat": self.beat, "step": self.step, "phase": self.phase, "pid": os.getpid(),
                   "host": self.host, "time": time.time()}
            self.store.set(f"rank{self.rank}", json.dumps(doc))

    def _beat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._write()
            except Exception as err:  # noqa: BLE001 - the store went away: the group is ending
                if not self._stop.is_set():
                    log(f"[tessel heartbeat] rank {self.rank}: heartbeat stopped: {err}")
                return
            self._wake.wait(self.period)
            self._wake.clear()

    def _watch_loop(self) -> None:
        ages = BeatAges()
        while not self._stop.wait(self.period):
            try:
                docs = read_beats(self.store, range(self.world))
            except Exception as err:  # noqa: BLE001
                if not self._stop.is_set():
                    log(f"[tessel watchdog] rank {self.rank}: watchdog stopped: {err}")
                return
            now = time.monotonic()
            ages.update(docs, now)
            stalled = ages.stale(now, self.timeout, ignore={self.rank})
            if stalled and not self._stop.is_set():
                self._act(sorted(stalled), {r: age for r, (age, _) in stalled.items()},
                          {r: doc for r, (_, _, doc) in ages.seen.items()})
                return

    def _act(self, stalled: list[int], ages: dict[int, float], docs: dict[int, dict]) -> None:
        healthy = [r for r in range(self.world) if r not in stalled]
        for r in stalled:
            doc = docs[r]
            if self.rank == min(healthy):
                log(f"[tessel watchdog] rank {r} (pid {doc['pid']} on {doc['host']}) is stalled: no heartbeat "
                    f"for {ages[r]:.1f}s (timeout {self.timeout:.1f}s); it was at step {doc['step']}, "
                    f"phase '{doc['phase']}'. Exiting so that the group restarts.")
            # the lowest healthy rank on the stalled rank's host ends it: a stopped process would
            # otherwise hold the agent's restart for its 30 s SIGTERM grace period
            local = [h for h in healthy if docs.get(h, {}).get("host") == doc["host"]]
            if self.kill_stalled and local and min(local) == self.rank:
                try:
                    os.kill(int(doc["pid"]), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.on_stall({r: docs[r] for r in stalled})


class BeatAges:
    """When each rank's beat counter last moved (this process's monotonic clock); 'done' ranks drop out.

    Ranks are judged by their own beats on our clock, so hosts' clocks need not agree.
    """

    def __init__(self):
        self.seen: dict[int, tuple[int, float, dict]] = {}  # rank -> (beat, when it changed, its doc)

    def update(self, docs: dict[int, dict], now: float) -> None:
        for r, doc in docs.items():
            if doc["phase"] == "done":
                self.seen.pop(r, None)
            elif r not in self.seen or self.seen[r][0] != doc["beat"]:
                self.seen[r] = (doc["beat"], now, doc)

    def stale(self, now: float, timeout: float, ignore=()) -> dict[int, tuple[float, dict]]:
        """rank -> (seconds since its beat moved, its last doc), for those past `timeout`."""
        return {r: (now - t, doc) for r, (_, t, doc) in self.seen.items() if r not in ignore and now - t > timeout}


def read_beats(store, ranks) -> dict[int, dict]:
    return {r: json.loads(store.get(f"rank{r}")) for r in ranks if store.check([f"rank{r}"])}


def watch_beats(ranks, period: float, timeout: float, on_silent, stop: threading.Event) -> None:
    """on_silent(rank, seconds, last doc) once for each of `ranks` whose beat stops for `timeout` s.

    A rank that never beat is not judged (it may still be starting); runs until `stop` is set.
    The parameter server's servers use it to drop a frozen worker instead of waiting for it.
    """
    store = _store_client(max(10.0, 4 * period))
    if store is None:
        return
    ages, reported = BeatAges(), set()
    while not stop.wait(period):
        try:
            docs = read_beats(store, ranks)
        except Exception:  # noqa: BLE001 - the store went away: the group is ending
            return
        now = time.monotonic()
        ages.update(docs, now)
        for r, (age, doc) in ages.stale(now, timeout, ignore=reported).items():
            reported.add(r)
            on_silent(r, age, doc)


# ---- stragglers ----------------------------------------------------------------
class ForwardTimer:
    """Sums the wall time of a module's forward passes (hooks; no change to the model)."""

    def __init__(self, module: torch.nn.Module, device: torch.device):
        self.total, self._t0, self.device = 0.0, None, device
        module.register_forward_pre_hook(self._pre)
        module.register_forward_hook(self._post)

    def _pre(self, *_):
        # training forwards only: evaluation and sampling run without grad and are not a step's work
        self._t0 = time.perf_counter() if torch.is_grad_enabled() else None

    def _post(self, *_):
        if self._t0 is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if self._t0 is not None:
            self.total += time.perf_counter() - self._t0

    def take(self) -> float:
        t, self.total = self.total, 0.0
        return t


def straggler_report(times: list[float], factor: float, min_gap_s: float) -> dict:
    """Per-rank local times -> metrics; the slowest rank is compared with the median of the others
    (with two ranks a median over all would be their mean); `straggler_rank` is -1 if none stands out."""
    slow = max(range(len(times)), key=lambda r: times[r])
    others = [t for r, t in enumerate(times) if r != slow] or [times[slow]]
    med = statistics.median(others)
    ratio = times[slow] / med if med > 0 else 1.0
    is_straggler = len(times) > 1 and ratio > factor and times[slow] - med > min_gap_s
    return {"straggler_ratio": ratio, "straggler_rank": slow if is_straggler else -1,
            "rank_time_max_s": times[slow], "rank_time_median_s": med}


def gather_times(local: float, device: torch.device) -> list[float]:
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return [local]
    out = [torch.zeros(1, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(out, torch.tensor([local], device=device))
    return [float(t.item()) for t in out]


# ---- fault injection ------------------------------------------------------------
@dataclass
class Fault:
    kind: str  # kill | stop | nan | slow
    rank: int = 0
    step: int = 0
    count: int = 1
    seconds: float = 0.0
    spec: str = ""
    remaining: int = field(default=0)


def parse_faults(text: str | None) -> list[Fault]:
    faults = []
    for spec in filter(None, (s.strip() for s in (text or "").split(","))):
        kind, *fields = spec.split(":")
        if kind not in ("kill", "stop", "nan", "slow"):
            raise ValueError(f"TESSEL_FAULT: unknown fault kind {kind!r} in {spec!r}")
        kw = dict(f.split("=", 1) for f in fields)
        faults.append(Fault(kind, int(kw.get("rank", 0)), int(kw.get("step", 0)), int(kw.get("count", 1)),
                            float(kw.get("seconds", 0.0)), spec))
    return faults


class FaultInjector:
    """Fires TESSEL_FAULT's faults on this rank, each once across restarts."""

    def __init__(self, rank: int, marker_dir: Path, text: str | None = None):
        self.rank = rank
        self.faults = [f for f in parse_faults(text if text is not None else os.environ.get("TESSEL_FAULT"))
                       if f.rank == rank]
        self.marker_dir = Path(os.environ.get("TESSEL_FAULT_DIR") or marker_dir)

    def _marker(self, f: Fault) -> Path:
        return self.marker_dir / f".fault-{hashlib.sha1(f.spec.encode()).hexdigest()[:12]}"

    def _claim(self, f: Fault) -> bool:
        """True the first time (across restarts) this fault reaches its step."""
        marker = self._marker(f)
        if marker.exists():
            return False
        self.marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "w") as fh:
            fh.write(f.spec)
            fh.flush()
            os.fsync(fh.fileno())
        return True

    def before_step(self, step: int) -> None:
        for f in self.faults:
            if f.step == step and f.kind in ("kill", "stop") and self._claim(f):
                log(f"[tessel fault] injecting {f.kind} on rank {self.rank} at step {step}")
                os.kill(os.getpid(), signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
            if f.step == step and f.kind == "nan" and self._claim(f):
                f.remaining = f.count

    def slow_seconds(self, step: int) -> float:
        return sum(f.seconds for f in self.faults if f.kind == "slow" and f.step <= step < f.step + f.count)

    def poison(self, params) -> bool:
        """Turn one gradient NaN while a nan fault is active (after backward, before the step)."""
        for f in self.faults:
            if f.kind == "nan" and f.remaining > 0:
                f.remaining -= 1
                for p in params:
                    if p.grad is not None:
                        p.grad.view(-1)[0] = float("nan")
                        return True
        return False

    def cancel(self) -> None:
        """A rollback ends active faults (they fire once, not again on the replayed steps)."""
        for f in self.faults:
            f.remaining = 0
