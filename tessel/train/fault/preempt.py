"""Stopping a run on a signal, and the control folder the launcher and the ranks share.

Schedulers preempt with SIGTERM, terminals close with SIGHUP, users press
Ctrl-C. A rank that gets any of them finishes the step it is in; at the step's
end every rank agrees (one all-reduce, shared with the finite-loss check) to
stop, writes a checkpoint if checkpoints are on (a preemption save), and exits
with 128 + the signal. Under `tessel train`'s launcher a stopped rank exits 0
instead, so that torchrun does not restart it, and reports the stop through
the control folder; the launcher then exits 128 + the signal
(tessel.commands.supervise).

The control folder (`TESSEL_CONTROL_DIR`, made by the launcher in /dev/shm
when it can, so that a full disk cannot silence it) holds:
- `config.json`: the validated config every rank runs;
- `stop`: the signal the launcher received (ranks poll it every step, so a rank
  that started after the signal was sent still stops);
- `stopped`: written by rank 0 when the run stopped early on a signal;
- `fatal`: the one-line error of a failure a restart would repeat
  (tessel.errors.FatalError): the launcher does not restart the run.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
from pathlib import Path

ENV = "TESSEL_CONTROL_DIR"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(Exception):
    """The run stopped on a signal after `step` steps."""

    def __init__(self, signum: int, step: int):
        super().__init__(f"stopped by {signal.Signals(signum).name} after step {step}")
        self.signum, self.step = signum, step


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class ControlDir:
    """The files through which a launcher and its ranks talk (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    @classmethod
    def create(cls) -> "ControlDir":
        shm = Path("/dev/shm")
        base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
        return cls(tempfile.mkdtemp(prefix="tessel-run-", dir=base))

    @classmethod
    def from_env(cls) -> "ControlDir | None":
        path = os.environ.get(ENV)
        return cls(path) if path else None

    @property
    def config_path(self) -> Path:
        return self.path / "config.json"

    def request_stop(self, signum: int) -> None:
        _write_atomic(self.path / "stop", str(int(signum)))

    def stop_requested(self) -> int:
        try:
            return int((self.path / "stop").read_text())
        except (OSError, ValueError):
            return 0

    def report_stopped(self, signum: int, step: int) -> None:
        _write_atomic(self.path / "stopped", json.dumps({"signal": int(signum), "step": step}))

    def stopped(self) -> int:
        """The signal the run stopped on, 0 if it did not stop early."""
        try:
            return int(json.loads((self.path / "stopped").read_text())["signal"])
        except (OSError, ValueError, KeyError, TypeError):
            return 0

    def report_fatal(self, message: str) -> None:
        _write_atomic(self.path / "fatal", message)

    def fatal(self) -> str | None:
        try:
            return (self.path / "fatal").read_text()
        except OSError:
            return None

    def remove(self) -> None:
        for f in self.path.glob("*"):
            f.unlink(missing_ok=True)
        for f in self.path.glob(".*"):
            f.unlink(missing_ok=True)
        self.path.rmdir()


class StopRequest:
    """This rank's view of a stop: a signal it received, or the launcher's request in the control folder."""

    def __init__(self, control: ControlDir | None = None):
        self.control = control
        self.signum = 0

    def install(self) -> "StopRequest":
        """Handle SIGINT, SIGTERM and SIGHUP by asking to stop (main thread only)."""
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_signal)
        return self

    def _on_signal(self, signum: int, _frame) -> None:
        if not self.signum:
            self.signum = signum
            print(f"[tessel] rank {os.environ.get('RANK', 0)}: {signal.Signals(signum).name}: stopping after "
                  "this step", file=sys.stderr, flush=True)

    def pending(self) -> int:
        """The signal to stop on, 0 for none (checked once per step)."""
        if not self.signum and self.control is not None:
            self.signum = self.control.stop_requested()
        return self.signum
