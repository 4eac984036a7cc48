"""The end-of-run summary printed by rank 0."""

from __future__ import annotations

from rich.console import Console
from rich.panel import Panel
from rich.table import Table


def print_summary(summary) -> None:
    console = Console()
    if summary.sample:
        console.print(Panel(summary.sample, title="sample", expand=False))
    table = Table(title="run summary", show_header=False)
    loss = f"{summary.losses[0]:.3f} -> {summary.losses[-1]:.3f}" if summary.losses else "-"
    rows = [
        ("steps", f"{summary.steps}"),
        ("parameters", f"{summary.params:,}"),
        ("train loss", loss),
        ("val loss", "-" if summary.val_loss is None else f"{summary.val_loss:.3f}"),
        ("tokens/s (median)", f"{summary.tokens_per_s:,.0f}"),
        ("MFU (median)", f"{100 * summary.mfu:.2f}%"),
        ("peak memory per rank", f"{summary.peak_mem_mb:,.0f} MiB"),
    ]
    rows += [(name, path) for name, path in summary.files.items()]
    for key, value in rows:
        table.add_row(key, value)
    console.print(table)
