"""Liveness of ranks through the torch.distributed store: a heartbeat per rank and watchdogs over them.

A daemon thread per rank writes (beat, step, phase, pid, host) to the store
every `heartbeat_s`. The trainer's watchdog thread on every rank reads all
ranks' beats; a rank whose beat has not advanced for `hang_timeout_s` (a frozen
or dead process: its heartbeat thread stops with it) is reported with what it
was doing, and the group exits non-zero so torchrun's agent restarts it. The
watchdog on the stalled rank's host also SIGKILLs it, since a stopped process
ignores the agent's SIGTERM for 30 s. Collectives themselves time out after
runtime.timeout_s (the backstop for a rank that is alive but stuck). The
parameter server's servers watch their workers' beats the same way
(watch_beats) and drop a silent worker instead.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time

import torch.distributed as dist

from tessel.runtime import job_store

STALL_EXIT_CODE = 43


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _store_client(timeout_s: float):
    """A connection of our own to the job's store (the threads must not share the trainer's); None outside a job."""
    if not os.environ.get("MASTER_ADDR") or not os.environ.get("MASTER_PORT"):
        return None
    # the ranks left after an eviction (tessel.elastic.adaptive.regroup)
    regroup = os.environ.get("TESSEL_REGROUP", "0")
    return dist.PrefixStore(f"tessel-hb/{regroup}/", job_store(timeout_s))


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
