"""Progress bars: rank 0's training bar (loss, throughput, MFU), and work_progress for other long work.

Both draw on rich's console (rich.get_console()), so a bar for a checkpoint's
checksums nests under the live training bar instead of fighting it. Long work
beyond training (checksumming and loading checkpoints, tokenizing, the
planner's search, the simulator) shows a transient bar on a terminal and
nothing at all in a log or a pipe, where its one-line messages say what
happened.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

from rich import get_console
from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Work:
    """What long work reports to its bar; does nothing when there is no terminal to draw on."""

    def __init__(self, bar: RichProgress | None = None, task=None):
        self.bar, self.task = bar, task

    def advance(self, amount: float = 1) -> None:
        if self.bar is not None:
            self.bar.advance(self.task, amount)

    def update(self, completed: float, total: float | None = None) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=completed, total=total)


@contextmanager
def work_progress(what: str, total: float | None = None, in_bytes: bool = False,
                  console: Console | None = None) -> Iterator[Work]:
    """A transient bar for `what` on a terminal (total None: a pulse); quiet when not a terminal."""
    console = console or get_console()
    if not console.is_terminal:
        yield Work()
        return
    count = DownloadColumn() if in_bytes else MofNCompleteColumn()
    with RichProgress(TextColumn(what), BarColumn(), count, TimeRemainingColumn(), console=console,
                      transient=True) as bar:
        yield Work(bar, bar.add_task(what, total=total))


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        if enabled:
            self.bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                console=get_console(), transient=False, refresh_per_second=4)
            self.task = self.bar.add_task("train", total=total, stats="")

    def __enter__(self) -> "Progress":
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, step: int, row: dict) -> None:
        if self.bar is None:
            return
        stats = (f"loss {row['loss']:.3f}  lr {row['lr']:.2e}  {row['tokens_per_s']:,.0f} tok/s  "
                 f"MFU {100 * row['mfu']:.1f}%")
        if "val_loss" in row:
            stats += f"  val {row['val_loss']:.3f}"
        self.bar.update(self.task, completed=step + 1, stats=stats)
        if not self.bar.console.is_terminal and (step % 10 == 0):
            # no live bar in a log file or a pipe: print a plain line now and then
            self.bar.console.print(f"step {step + 1}: {stats}")
