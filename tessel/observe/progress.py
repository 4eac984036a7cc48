"""A rich progress bar for rank 0, with the step's loss, throughput and MFU."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
from rich.progress import Progress as RichProgress


class Progress:
    def __init__(self, total: int, enabled: bool = True):
        self.enabled = enabled
        self.bar = None
        if enabled:
            self.bar = RichProgress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[stats]}"), TimeRemainingColumn(),
                console=Console(stderr=False), transient=False, refresh_per_second=4)
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
