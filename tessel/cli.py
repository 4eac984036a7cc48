"""The `tessel` command: train, plan, simulate (more subcommands join as their issues land)."""

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
    resume: Optional[str] = typer.Option(None, "--resume", help="'auto' (newest valid checkpoint) or a path"),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="elastic node range MIN:MAX (re-plans dp)"),
    nproc: Optional[int] = typer.Option(None, "--nproc-per-node", help="ranks per node; other than the "
                                        "layout's world size, the layout is re-planned (elastic)"),
) -> None:
    """Train the reference GPT with the recipe's parallel layout."""
    from tessel.launch import reexec, run_rank, under_torchrun

    extra = []
    if resume is not None:
        extra.append(f'checkpoint.resume="{resume}"')
    if (nnodes and ":" in nnodes) or nproc is not None:
        extra.append("runtime.elastic=true")
    try:
        cfg = load_config(recipe, [*set_, *extra])
        if nproc is not None and not under_torchrun():
            from tessel.train.elastic import replan
            replan(cfg, nproc)  # rejects a size the layout cannot take, before anything is spawned
    except ConfigError as err:
        fail(err)
    if under_torchrun():
        run_rank(cfg)  # does not return
    raise typer.Exit(reexec(cfg, sys.argv[1:], max_restarts, nnodes, nproc))


_PLAN_OPTS = dict(
    cluster=typer.Option("a100", "--cluster", help="a100 | h100 | this (this machine, probed and cached)"),
    world=typer.Option(None, "--world", help="devices; default the recipe's layout or one node"),
    model=typer.Option(None, "--model", help="model preset, e.g. gpt3-175b (default: the recipe's model)"),
    global_batch=typer.Option(None, "--global-batch", help="sequences per step (default recipe/preset)"),
    precision=typer.Option(None, "--precision", help="fp32 | bf16"),
    layout=typer.Option(None, "--layout", help="evaluate one layout: dp=2,tp=2,pp=2,mb=1,zero=1,v=2,..."),
    as_json=typer.Option(False, "--json", help="print machine-readable results"),
    refresh=typer.Option(False, "--refresh", help="re-measure this machine instead of using the cache"),
)


@app.command()
def plan(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe (its model and batch are planned)"),
    set_: List[str] = typer.Option([], "--set", help="override a recipe field"),
    cluster: str = _PLAN_OPTS["cluster"], world: Optional[int] = _PLAN_OPTS["world"],
    model: Optional[str] = _PLAN_OPTS["model"], global_batch: Optional[int] = _PLAN_OPTS["global_batch"],
    precision: Optional[str] = _PLAN_OPTS["precision"], layout: Optional[str] = _PLAN_OPTS["layout"],
    as_json: bool = _PLAN_OPTS["as_json"], refresh: bool = _PLAN_OPTS["refresh"],
    out: Optional[str] = typer.Option(None, "--out", help="write the best layout as a recipe"),
    top: int = typer.Option(8, "--top", help="rows in the table"),
) -> None:
    """Choose the parallel layout from the cost model: rank every layout that fits, explain the winner."""
    from tessel.planner import commands
    try:
        prob = commands.resolve(recipe, set_, cluster, world, model, global_batch, precision, refresh=refresh)
        commands.plan(prob, layout, as_json, out, top)
    except ConfigError as err:
        fail(err)


@app.command()
def simulate(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe"),
    set_: List[str] = typer.Option([], "--set", help="override a recipe field"),
    cluster: str = _PLAN_OPTS["cluster"], world: Optional[int] = _PLAN_OPTS["world"],
    model: Optional[str] = _PLAN_OPTS["model"], global_batch: Optional[int] = _PLAN_OPTS["global_batch"],
    precision: Optional[str] = _PLAN_OPTS["precision"], layout: Optional[str] = _PLAN_OPTS["layout"],
    as_json: bool = _PLAN_OPTS["as_json"], refresh: bool = _PLAN_OPTS["refresh"],
    trace: str = typer.Option("runs/simulate/trace.json", "--trace", help="Chrome trace output"),
    png: str = typer.Option("runs/simulate/timeline.png", "--png", help="timeline image output"),
) -> None:
    """Simulate one step of a plan (the best one, or --layout) event by event; write a trace and a timeline."""
    from tessel.planner import commands
    try:
        prob = commands.resolve(recipe, set_, cluster, world, model, global_batch, precision, refresh=refresh)
        commands.simulate(prob, layout, trace, png, as_json)
    except ConfigError as err:
        fail(err)
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


bench_app = typer.Typer(no_args_is_help=True, help="Micro-benchmarks.")
app.add_typer(bench_app, name="bench")


def _standalone(nproc: int) -> int:
    """Re-run this command under torchrun on `nproc` local ranks (no-op under torchrun)."""
    import os
    import subprocess
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={nproc}", "-m", "tessel", *sys.argv[1:]]
    return subprocess.run(cmd, env=env).returncode


@bench_app.command("comm")
def bench_comm(
    world: int = typer.Option(4, "--world", help="local ranks when not already under torchrun"),
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all", help="comma-separated"),
    algorithms: str = typer.Option("", help="comma-separated subset of native,ring,hierarchical (all)"),
    sizes: str = typer.Option("4K,1M,16M", help="comma-separated sizes in bytes (K/M/G suffixes)"),
    iters: int = typer.Option(5, min=1),
    warmup: int = typer.Option(1, min=0),
    topology: Optional[str] = typer.Option(None, help="topology file from `tessel probe`"),
    node_size: Optional[int] = typer.Option(None, "--node-size", help="ranks per node when there is no topology file"),
    json_out: Optional[str] = typer.Option(None, "--json", help="also write the rows as JSON (rank 0)"),
) -> None:
    """nccl-tests-style table: op, algorithm, size, time, algbw, busbw."""
    from tessel.comm.bench import ALGORITHMS, parse_size, run_rank
    from tessel.launch import under_torchrun

    op_list = [o.strip() for o in ops.split(",") if o.strip()]
    bad = [o for o in op_list if o not in ALGORITHMS]
    if bad:
        typer.secho(f"error: unknown op(s) {bad}; known: {list(ALGORITHMS)}", fg="red", err=True)
        raise typer.Exit(2)
    if not under_torchrun():
        raise typer.Exit(_standalone(world))
    algos = [a.strip() for a in algorithms.split(",") if a.strip()]
    run_rank(op_list, algos, [parse_size(x) for x in sizes.split(",")], iters, warmup, topology,
             node_size, json_out)


@app.command()
def probe(
    world: int = typer.Option(4, "--world", help="local ranks when not already under torchrun"),
    out: str = typer.Option("runs/topology.json", help="where rank 0 writes the topology file"),
    size_mb: float = typer.Option(4.0, help="bandwidth message size (MiB)"),
    reps: int = typer.Option(3, min=1),
) -> None:
    """Measure bandwidth/latency between every pair of ranks; infer nodes; write a topology file."""
    from tessel.launch import under_torchrun

    if not under_torchrun():
        raise typer.Exit(_standalone(world))
    from tessel.comm.probe import run_rank
    run_rank(out, size_mb, reps)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
