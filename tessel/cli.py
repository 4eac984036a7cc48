"""The `tessel` command: train (more subcommands join as their issues land)."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from tessel.config import ConfigError, load_config

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tessel: distributed training of large models on torch.distributed.")


@app.callback()
def root() -> None:
    """tessel: distributed training of large models on torch.distributed."""


def fail(err: ConfigError) -> None:
    """Config errors are the user's to fix: one line naming the field, exit 2, no traceback."""
    typer.secho(f"error: invalid config: {err}", fg="red", err=True)
    raise typer.Exit(2)


@app.command()
def train(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe; defaults apply when omitted"),
    set_: List[str] = typer.Option([], "--set", help="override a field: --set parallel.dp=2"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts after a rank dies"),
) -> None:
    """Train the reference GPT with the recipe's parallel layout."""
    from tessel.launch import reexec, run_rank, under_torchrun

    try:
        cfg = load_config(recipe, set_)
    except ConfigError as err:
        fail(err)
    if under_torchrun():
        run_rank(cfg)  # does not return
    raise typer.Exit(reexec(cfg, sys.argv[1:], max_restarts))


@app.command()
def plot(metrics: str = typer.Argument(..., help="a metrics.jsonl written by tessel train"),
         out: str = typer.Option("curves.png", "--out", help="PNG to write")) -> None:
    """Plot loss, validation loss, throughput and learning rate of a run."""
    from pathlib import Path

    from tessel.observe.plots import plot_metrics
    if not Path(metrics).is_file():
        typer.secho(f"error: no such file: {metrics}", fg="red", err=True)
        raise typer.Exit(2)
    typer.echo(plot_metrics(metrics, out))


def main() -> None:
    app()


if __name__ == "__main__":
    main()
