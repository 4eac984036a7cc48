"""The `tessel` command: train, plan, simulate (more subcommands join as their issues land)."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import List, NoReturn, Optional

import typer

from tessel.commands import launch
from tessel.commands.combinations import combinations_markdown
from tessel.commands.config_doc import config_markdown
from tessel.commands.supervise import Supervisor
from tessel.config import Config, ConfigError, load_config
from tessel.elastic.rank import run_rank
from tessel.planner.layout import ALIASES, KEY_HELP
from tessel.train.fault.preempt import ControlDir

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="tessel: distributed training of large models on torch.distributed.")


@app.callback()
def root() -> None:
    """tessel: distributed training of large models on torch.distributed."""


def fail(err: ConfigError) -> NoReturn:
    """Bad input is the user's to fix: one line naming the field or argument, exit 2, no traceback.

    Recipe fields are dotted (parallel.tp); command-line ones are flags (--world) or, for
    positional arguments, upper case (METRICS)."""
    is_argument = err.field.startswith("-") or err.field.isupper()
    _error_line(str(err) if is_argument else f"invalid config: {err}")
    raise typer.Exit(2)


def _error_line(message: str) -> None:
    typer.secho("error: " + " ".join(message.split()), fg="red", err=True)  # one line, whatever the message


@app.command()
def train(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe; defaults apply when omitted"),
    set_: List[str] = typer.Option([], "--set", help="override a field: --set parallel.dp=2"),
    max_restarts: int = typer.Option(0, "--max-restarts", help="torchrun restarts after a rank dies"),
    resume: Optional[str] = typer.Option(None, "--resume", help="'auto' (newest valid checkpoint of this "
                                         "run) or a checkpoint folder"),
    nnodes: Optional[str] = typer.Option(None, "--nnodes", help="nodes: N, or an elastic range MIN:MAX "
                                         "(re-plans dp); more than one needs TESSEL_RDZV_ENDPOINT"),
    nproc: Optional[int] = typer.Option(None, "--nproc-per-node", help="ranks per node; other than the "
                                        "layout's world size, the layout is re-planned (elastic)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the run whose files are in "
                                   "logging.out_dir (deletes its metrics and checkpoints)"),
    force: bool = typer.Option(False, "--force", help="start even if the planner estimates more memory per "
                               "rank than the device has"),
    grace_s: float = typer.Option(120.0, "--grace", help="seconds a signalled run gets to finish its step "
                                  "and save before it is killed"),
) -> None:
    """Train the reference GPT with the recipe's parallel layout."""
    opts = launch.LaunchOptions(max_restarts, resume, nnodes, nproc, overwrite, force, grace_s)
    try:
        cfg = load_config(recipe, set_)
        if launch.under_torchrun():  # started by the user's torchrun: this process is a rank
            run_rank(launch.with_resume(cfg, resume), overwrite=overwrite)  # does not return
        checked = launch.preflight(cfg, opts)
        code = launch.launch(checked, opts)
    except ConfigError as err:
        fail(err)
    raise typer.Exit(code)


@app.command("_rank", hidden=True)
def rank_entry(config: str = typer.Argument(..., help="the validated config the launcher wrote")) -> None:
    """One rank of a launched run (tessel train starts these through torchrun)."""
    cfg = Config.model_validate_json(Path(config).read_text())
    run_rank(cfg, ControlDir(Path(config).parent), os.environ.get("TESSEL_RUN_ID"))


_PLAN_OPTS = dict(
    cluster=typer.Option("a100", "--cluster", help="a100 | h100 | h200 | this (this machine, probed and cached)"),
    world=typer.Option(None, "--world", help="devices; default the recipe's layout or one node"),
    model=typer.Option(None, "--model", help="model preset, e.g. gpt3-175b (default: the recipe's model)"),
    global_batch=typer.Option(None, "--global-batch", help="sequences per step (default recipe/preset)"),
    precision=typer.Option(None, "--precision", help="fp32 | bf16"),
    layout=typer.Option(None, "--layout", help="evaluate one layout: dp=2,tp=2,pp=2,micro_batch=1,zero_stage=1,... "
                        "Keys: " + "; ".join(f"{k}: {v}" for k, v in KEY_HELP.items())
                        + ". Aliases: " + ", ".join(f"{a}={k}" for a, k in ALIASES.items())),
    as_json=typer.Option(False, "--json", help="print machine-readable results"),
    refresh=typer.Option(False, "--refresh", help="re-measure this machine instead of using the cache"),
)


@app.command()
def plan(
    recipe: Optional[str] = typer.Argument(None, help="TOML recipe (its model and batch are planned)"),
    set_: List[str] = typer.Option([], "--set", help="override a recipe field (--set train.seq_len=4096) or a "
                                   "cluster constant (--set cluster.inter.bandwidth=50e9, cluster.sharp=true, "
                                   "cluster.gemm_efficiency=0.7: any field of tessel/planner/cluster.py)"),
    cluster: str = _PLAN_OPTS["cluster"], world: Optional[int] = _PLAN_OPTS["world"],
    model: Optional[str] = _PLAN_OPTS["model"], global_batch: Optional[int] = _PLAN_OPTS["global_batch"],
    precision: Optional[str] = _PLAN_OPTS["precision"], layout: Optional[str] = _PLAN_OPTS["layout"],
    as_json: bool = _PLAN_OPTS["as_json"], refresh: bool = _PLAN_OPTS["refresh"],
    out: Optional[str] = typer.Option(None, "--out", help="write the best layout as a recipe"),
    top: int = typer.Option(8, "--top", help="rows in the table"),
    fix: Optional[str] = typer.Option(None, "--fix", help="pin part of the layout, search the rest: "
                                      "tp=8,recompute=selective (the --layout keys)"),
    tokens: Optional[float] = typer.Option(None, "--tokens", help="tokens to train on (300e9): print the "
                                           "winner's time to train in days"),
    explain: bool = typer.Option(False, "--explain", help="list every term of the winner's step"),
    network: bool = typer.Option(False, "--network", help="search and simulate again with and without rails "
                                 "and SHARP: what each gains, and the layout each chooses"),
) -> None:
    """Choose the parallel layout from the cost model: rank every layout that fits, explain the winner."""
    from tessel.commands import planning as commands  # deferred: the cost model and rich (`tessel train` needs neither)
    try:
        fixed = commands.check_plan_args(top, out, tokens, fix, layout, network, cluster)
        prob = commands.resolve(recipe, set_, cluster, world, model, global_batch, precision, layout,
                                refresh=refresh, fixed=fixed)
        commands.plan(prob, commands.PlanOptions(top, out, as_json, tokens, explain, network))
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
    tp_modes: Optional[str] = typer.Option(None, "--tp-modes", help="compare tensor parallelism 1d, 2d, 2.5d and 3d "
                                           "at these tp group sizes (8,64,512): each mode's best layout, simulated"),
) -> None:
    """Simulate one step of a plan (the best one, or --layout) event by event; write a trace and a timeline."""
    from tessel.commands import planning as commands  # deferred: the cost model and rich (`tessel train` needs neither)
    try:
        commands.check_simulate_args(trace, png)
        sizes = commands.check_tp_modes_arg(tp_modes, layout)
        prob = commands.resolve(recipe, set_, cluster, world, model, global_batch, precision, layout,
                                refresh=refresh)
        if sizes:
            commands.simulate_tp_modes(prob, sizes, as_json)
            return
        commands.simulate(prob, trace, png, as_json)
    except ConfigError as err:
        fail(err)


@app.command()
def plot(metrics: str = typer.Argument(..., help="a metrics.jsonl written by tessel train"),
         out: str = typer.Option("curves.png", "--out", help="PNG to write")) -> None:
    """Plot loss, validation loss, throughput and learning rate of a run."""
    from tessel.observe.plots import check_plot_args, plot_metrics  # deferred: loads matplotlib (half a second)
    try:
        check_plot_args(metrics, out)
    except ConfigError as err:
        fail(err)
    typer.echo(plot_metrics(metrics, out))


@app.command()
def export(
    checkpoint: str = typer.Argument(..., help="a checkpoint folder (step_N) of any layout"),
    fmt: str = typer.Option("hf", "--format", help="hf: a folder AutoModelForCausalLM.from_pretrained loads"),
    out: str = typer.Option(..., "--out", help="the folder to write"),
    config: Optional[str] = typer.Option(None, "--config", help="a Hugging Face model's config.json, when the "
                                         "checkpoint carries none and the recipe's has moved"),
    dtype: Optional[str] = typer.Option(None, "--dtype", help="fp32 | bf16 | fp16 (default: as saved)"),
    shard_mb: float = typer.Option(5000.0, "--shard-mb", help="largest safetensors file before sharding (MiB)"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace a non-empty --out folder"),
) -> None:
    """Export a checkpoint's model: a Hugging Face model under its own names, the reference GPT as a Llama."""
    from tessel.commands.export import check_export, export_hf  # deferred: loads torch and the checkpoint reader
    try:
        job = check_export(checkpoint, fmt, out, config, dtype, shard_mb, overwrite)
    except ConfigError as err:
        fail(err)
    typer.echo(f"exported {job.checkpoint} -> {export_hf(job)}")


@app.command()
def support(
    out: Optional[str] = typer.Option(None, "--out", help="write the markdown here (docs/support.md, or "
                                      "docs/combinations.md with --strategies) instead of printing it"),
    strategies: bool = typer.Option(False, "--strategies", help="strategy x strategy: every pair of strategies "
                                    "through the checks tessel train runs before spawning"),
) -> None:
    """Which Hugging Face family trains on which axis: the installed transformers' families, tessel's rules
    and the parity sweep's record, as a markdown table (nothing is spawned; no model is built). With
    --strategies: which strategy combines with which, from the same checks."""
    if strategies:
        _write_or_print(combinations_markdown(), out)
        return
    from tessel.commands.support import support_markdown  # deferred: loads transformers' config classes
    _write_or_print(support_markdown(), out)


@app.command("config-doc")
def config_doc(
    out: Optional[str] = typer.Option(None, "--out", help="write the markdown here (docs/config.md) instead of "
                                      "printing it"),
) -> None:
    """The configuration reference: every recipe section and field, its type, default, choices and description,
    read from the schema (tessel/config/schema.py)."""
    _write_or_print(config_markdown(), out)


def _write_or_print(text: str, out: Optional[str]) -> None:
    if out is None:
        typer.echo(text, nl=False)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text, encoding="utf-8")
    typer.echo(f"wrote {out}")


data_app = typer.Typer(no_args_is_help=True, help="Token data.")
app.add_typer(data_app, name="data")


@data_app.command("prepare")
def data_prepare(
    input_: str = typer.Argument(..., metavar="INPUT", help="a text or JSONL file, or a folder of them"),
    tokenizer: str = typer.Option(..., "--tokenizer", help="a tokenizer.json, or stdlib-bpe-N (tessel's BPE)"),
    out: str = typer.Option(..., "--out", help="the folder for train.bin, val.bin, tokenizer.json"),
    model_config: Optional[str] = typer.Option(None, "--model-config", help="check the vocabulary against this "
                                               "Hugging Face config.json"),
    recipe: Optional[str] = typer.Option(None, "--recipe", help="... or against this recipe's model"),
    val_fraction: float = typer.Option(0.05, "--val-fraction", help="share of documents for val.bin"),
    workers: int = typer.Option(min(8, os.cpu_count() or 1), "--workers", help="tokenizing processes"),
    field: str = typer.Option("text", "--field", help="the JSONL field holding each document"),
    overwrite: bool = typer.Option(False, "--overwrite", help="replace the .bin files in --out"),
) -> None:
    """Tokenize text into the uint16 .bin files that data.source = "bin" reads, with a progress bar."""
    from tessel.train.prepare import check_prepare, prepare  # deferred: loads numpy and the tokenizer
    try:
        job = check_prepare(input_, tokenizer, out, model_config, recipe, val_fraction, workers, field, overwrite)
        report = prepare(job)
    except ConfigError as err:
        fail(err)
    typer.echo(f"{report['train_tokens']:,} train and {report['val_tokens']:,} val tokens -> {job.out}")


launch_app = typer.Typer(no_args_is_help=True, help="Run a recipe under a scheduler: the files it takes.")
app.add_typer(launch_app, name="launch")

_JOB_OPTS = dict(
    nodes=typer.Option(..., "--nodes", help="nodes; one torchrun per node"),
    gpus=typer.Option(None, "--gpus-per-node", help="ranks per node, one per GPU"),
    procs=typer.Option(None, "--procs-per-node", help="ranks per node on a CPU cluster (instead of GPUs)"),
    grace=typer.Option(120, "--grace", help="seconds a signalled run gets to finish its step and save"),
    no_requeue=typer.Option(False, "--no-requeue", help="a preempted job ends instead of coming back"),
)


@launch_app.command("slurm")
def launch_slurm(
    recipe: str = typer.Argument(..., help="TOML recipe"),
    set_: List[str] = typer.Option([], "--set", help="override a recipe field"),
    nodes: int = _JOB_OPTS["nodes"], gpus: Optional[int] = _JOB_OPTS["gpus"],
    procs: Optional[int] = _JOB_OPTS["procs"], grace: int = _JOB_OPTS["grace"],
    no_requeue: bool = _JOB_OPTS["no_requeue"],
    partition: Optional[str] = typer.Option(None, "--partition", help="sbatch --partition"),
    time: Optional[str] = typer.Option(None, "--time", help="sbatch --time (the job checkpoints --grace seconds "
                                       "before it and requeues itself)"),
    account: Optional[str] = typer.Option(None, "--account", help="sbatch --account"),
    job_name: str = typer.Option("tessel", "--job-name", help="sbatch --job-name"),
    cpus_per_task: Optional[int] = typer.Option(None, "--cpus-per-task", help="CPUs per node's task (default on "
                                                "a CPU cluster: ranks x runtime.threads_per_rank)"),
    port: int = typer.Option(29500, "--port", help="rendezvous port base (+ job id mod 1000)"),
    sbatch_arg: List[str] = typer.Option([], "--sbatch-arg", help="another #SBATCH line: --sbatch-arg=--qos=high"),
    out: Optional[str] = typer.Option(None, "--out", help="the script to write (default "
                                      "<logging.out_dir>/slurm/<job-name>.sbatch; the recipe and logs beside it)"),
    submit: bool = typer.Option(False, "--submit", help="submit it with sbatch"),
) -> None:
    """Write an sbatch script: one torchrun per node, c10d rendezvous, requeue with --resume auto."""
    from tessel.commands.launchers import commands as launch_commands  # deferred: yaml (`tessel train` never needs it)
    from tessel.commands.launchers.slurm import SlurmOptions  # deferred: as above
    opts = SlurmOptions(job_name, partition, time, account, cpus_per_task, port, not no_requeue, list(sbatch_arg))
    try:
        launch_commands.slurm(recipe, set_, nodes, gpus, procs, grace, opts, out, submit)
    except ConfigError as err:
        fail(err)


@launch_app.command("k8s")
def launch_k8s(
    recipe: str = typer.Argument(..., help="TOML recipe"),
    set_: List[str] = typer.Option([], "--set", help="override a recipe field"),
    nodes: int = _JOB_OPTS["nodes"], gpus: Optional[int] = _JOB_OPTS["gpus"],
    procs: Optional[int] = _JOB_OPTS["procs"], grace: int = _JOB_OPTS["grace"],
    no_requeue: bool = _JOB_OPTS["no_requeue"],
    image: str = typer.Option(..., "--image", help="a container image with tessel and its torch"),
    name: str = typer.Option("tessel", "--name", help="the PyTorchJob's name (its pods: <name>-master-0, ...)"),
    namespace: Optional[str] = typer.Option(None, "--namespace", help="Kubernetes namespace"),
    storage: str = typer.Option("100Gi", "--storage", help="size of the checkpoint volume claim"),
    storage_class: Optional[str] = typer.Option(None, "--storage-class", help="its storage class (ReadWriteMany)"),
    pvc: Optional[str] = typer.Option(None, "--pvc", help="use this existing claim instead of creating one"),
    max_restarts: int = typer.Option(3, "--max-restarts", help="pod restarts (runPolicy.backoffLimit)"),
    out: Optional[str] = typer.Option(None, "--out", help="the YAML to write (default: print it)"),
) -> None:
    """Write a Kubeflow PyTorchJob (with its recipe ConfigMap and checkpoint volume): one torchrun per pod."""
    from tessel.commands.launchers import commands as launch_commands  # deferred: yaml (`tessel train` never needs it)
    try:
        launch_commands.k8s(recipe, set_, nodes, gpus, procs, grace, not no_requeue,
                            launch_commands.K8sOptions(image, name, namespace, storage, storage_class, pvc,
                                                       max_restarts), out)
    except ConfigError as err:
        fail(err)


bench_app = typer.Typer(no_args_is_help=True, help="Micro-benchmarks.")
app.add_typer(bench_app, name="bench")


def _standalone(nproc: int) -> int:
    """Re-run this command under torchrun on `nproc` local ranks, supervised like `tessel train`:
    a signal stops every rank and nothing outlives the command (tessel.commands.supervise)."""
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={nproc}", "-m", "tessel", *sys.argv[1:]]
    control = ControlDir.create()
    try:
        return Supervisor(cmd, env, control, grace_s=10.0).run()
    finally:
        control.remove()


@bench_app.command("comm")
def bench_comm(
    world: int = typer.Option(4, "--world", help="local ranks when not already under torchrun"),
    ops: str = typer.Option("all_reduce,all_gather,reduce_scatter,all_to_all", help="comma-separated"),
    algorithms: str = typer.Option("", help="comma-separated subset of native,ring,hierarchical (all)"),
    sizes: str = typer.Option("4K,1M,16M", help="comma-separated sizes in bytes (K/M/G suffixes)"),
    iters: int = typer.Option(5, help="timed calls per size (at least 1)"),
    warmup: int = typer.Option(1, help="untimed calls first (0 or more)"),
    topology: Optional[str] = typer.Option(None, help="topology file from `tessel probe`"),
    node_size: Optional[int] = typer.Option(None, "--node-size", help="ranks per node when there is no topology file"),
    json_out: Optional[str] = typer.Option(None, "--json", help="also write the rows as JSON (rank 0)"),
) -> None:
    """nccl-tests-style table: op, algorithm, size, time, algbw, busbw."""
    from tessel.calibrate.bench import check_args, run_rank  # deferred: loads torch

    try:
        op_list, algos, size_list = check_args(world, ops, algorithms, sizes, iters, warmup, topology,
                                               node_size, json_out, launch.under_torchrun())
    except ConfigError as err:
        fail(err)
    if not launch.under_torchrun():
        raise typer.Exit(_standalone(world))
    run_rank(op_list, algos, size_list, iters, warmup, topology, node_size, json_out)


@app.command()
def probe(
    world: int = typer.Option(4, "--world", help="local ranks when not already under torchrun"),
    out: str = typer.Option("runs/topology.json", help="where rank 0 writes the topology file"),
    size_mb: float = typer.Option(4.0, help="bandwidth message size (MiB)"),
    reps: int = typer.Option(3, help="measurements per pair (at least 1)"),
) -> None:
    """Measure bandwidth/latency between every pair of ranks; infer nodes; write a topology file."""
    from tessel.calibrate.topology_probe import check_args, run_rank  # deferred: loads torch

    try:
        check_args(world, out, size_mb, reps)
    except ConfigError as err:
        fail(err)
    if not launch.under_torchrun():
        raise typer.Exit(_standalone(world))
    run_rank(out, size_mb, reps)


def main(argv: Optional[List[str]] = None) -> None:
    """Run the command line (argv defaults to sys.argv[1:]).

    typer runs without its standalone mode so that click's usage errors (a value that does
    not parse, an unknown option) reach us and print one line, as our own checks do, instead
    of a boxed panel; exit codes from typer.Exit come back as the return value."""
    try:
        code = app(argv, standalone_mode=False)
    except typer.TyperException as err:  # click's errors; usage errors carry exit code 2
        message = _usage_message(err)
        if message:  # empty for a bare `tessel` or `tessel bench`: the help is already printed
            _error_line(message)
        sys.exit(err.exit_code)
    except typer.Abort:  # Ctrl-C before any rank exists
        _error_line("aborted")
        sys.exit(128 + 2)
    sys.exit(code or 0)


def _usage_message(err: typer.TyperException) -> str:
    """`--world: input should be a valid integer` rather than click's `Invalid value for '--world': ...`;
    positional arguments upper case (METRICS), as fail() names them."""
    if isinstance(err, typer.BadParameter) and err.param is not None:
        param = err.param
        name = param.opts[0] if param.param_type_name == "option" else param.name.upper()
        what = err.message or f"missing {param.param_type_name}"  # a MissingParameter has no message
        return f"{name}: {what[:1].lower()}{what[1:]}"
    return err.format_message()


if __name__ == "__main__":
    main()
