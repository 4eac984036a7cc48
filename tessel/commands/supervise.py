"""Run a process tree to its end and leave none of it behind: the launcher's half of stopping a run.

`tessel train` starts torchrun, and torchrun starts every rank in a session of
its own. So a signal to the launcher's process group reaches no rank, and when
torchrun dies its ranks are re-parented to init and train on. The supervisor:

- makes this process a child subreaper (Linux `prctl`), so that descendants
  orphaned by torchrun's death are re-parented here and stay findable;
- starts the child in a session of its own, so that a terminal's Ctrl-C reaches
  only the supervisor, which forwards it exactly once;
- on SIGINT, SIGTERM or SIGHUP writes a stop request into the run's control
  folder and sends the signal to every descendant but the child itself (the
  ranks finish their step, save a checkpoint and exit; see
  tessel.train.fault.preempt), waits `grace_s`, then SIGKILLs every descendant; a
  second SIGINT kills at once;
- when the child exits, SIGKILLs and reaps whatever descendants remain;
- returns 128 + the signal when a signal stopped the run.

The child must not be told by torchrun: torchrun would restart ranks that exit
non-zero, so stopped ranks exit 0 and the stop request tells the supervisor
why. If this process is SIGKILLed, the child gets SIGTERM (PR_SET_PDEATHSIG) and
torchrun forwards it to the ranks.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tessel.train.fault.preempt import ControlDir

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
FATAL_GRACE_S = 10.0  # a rank reported a fatal error: the others get this long to notice and exit


def _prctl(option: int, value: int) -> None:
    """Linux only; elsewhere the supervisor still forwards signals, without the orphan safety net."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(option, value, 0, 0, 0)


def _die_with_parent() -> None:
    """preexec_fn of the child: SIGTERM when the supervisor dies, however it dies."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def descendants(root: int) -> list[int]:
    """Every live process below `root` (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue  # gone meanwhile
        # the command name is in parentheses and may hold spaces: fields start after the last ')'
        ppid = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            out.append(pid)
            todo.append(pid)
    return out


def _signal_all(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _reap_orphans() -> None:
    """Collect the exit status of re-parented descendants (we are their subreaper).

    Only once the child itself has been waited for: waitpid(-1) could otherwise take its status."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


class Supervisor:
    """Runs `cmd` with `env` until it and all its descendants are gone; see the module docstring."""

    def __init__(self, cmd: list[str], env: dict[str, str], control: ControlDir, grace_s: float,
                 say=lambda msg: print(msg, file=sys.stderr, flush=True)):
        self.cmd, self.env, self.control, self.grace_s, self.say = cmd, env, control, grace_s, say
        self.proc: subprocess.Popen | None = None
        self.signum = 0
        self.deadline: float | None = None

    def run(self) -> int:
        _prctl(PR_SET_CHILD_SUBREAPER, 1)
        previous = {s: signal.signal(s, self._on_signal) for s in STOP_SIGNALS}
        try:
            self.proc = subprocess.Popen(self.cmd, env=self.env, start_new_session=True,
                                         preexec_fn=_die_with_parent)
            while self.proc.poll() is None:
                self._tick()
                time.sleep(0.1)
        finally:
            self._kill_rest()
            for s, handler in previous.items():
                signal.signal(s, handler)
        return self._exit_code(self.proc.returncode if self.proc else 1)

    def _tick(self) -> None:
        """Enforce a stop's deadline; stop the run when a rank reported a fatal error."""
        now = time.monotonic()
        if self.deadline is not None and now > self.deadline:
            self.say(f"[tessel] the run did not stop within {self.grace_s:.0f}s: killing it")
            self._kill_rest()
            self.deadline = None
        if self.deadline is None and self.signum == 0 and self.control.fatal() is not None:
            self.deadline = now + FATAL_GRACE_S  # the ranks exit by themselves; this bounds a straggler

    def _on_signal(self, signum: int, _frame) -> None:
        name = signal.Signals(signum).name
        if self.signum:
            if signum == signal.SIGINT:
                self.say(f"[tessel] second {name}: killing the run now")
                self._kill_rest()
            return
        self.signum = signum
        self.say(f"[tessel] {name}: stopping the run; every rank finishes its step and saves a checkpoint "
                 f"if checkpoints are on (up to {self.grace_s:.0f}s; {'press Ctrl-C again' if signum == signal.SIGINT else 'SIGINT'} to kill now)")
        self.control.request_stop(signum)
        if self.proc is not None:
            _signal_all([p for p in descendants(os.getpid()) if p != self.proc.pid], signum)
        self.deadline = time.monotonic() + self.grace_s

    def _kill_rest(self) -> None:
        """SIGKILL every descendant until none is left, then reap them."""
        for _ in range(50):
            pids = descendants(os.getpid())
            if not pids:
                break
            _signal_all(pids, signal.SIGKILL)
            if self.proc is not None:
                try:
                    self.proc.wait(timeout=0.1)
                except subprocess.TimeoutExpired:
                    continue
            _reap_orphans()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.wait()

    def _exit_code(self, child_code: int) -> int:
        """128+signal if a signal cut the run short (ranks that stopped exit 0 so that torchrun
        does not restart them), 1 after a fatal error, else the child's own code."""
        stopped = self.control.stopped()
        if stopped or (self.signum and child_code != 0):
            return 128 + (stopped or self.signum)
        if self.control.fatal() is not None:
            return 1
        return child_code
