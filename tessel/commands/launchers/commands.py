"""The logic of `tessel launch slurm` and `tessel launch k8s`: check everything, then write (and submit)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import typer

from tessel.config import load_config, output_file
from tessel.commands.launchers import k8s as k8s_job
from tessel.commands.launchers import slurm as slurm_job
from tessel.commands.launchers.job import check_inputs, check_job


def slurm(recipe: str, overrides: list[str], nodes: int, gpus: int | None, procs: int | None, grace_s: int,
          opts: slurm_job.SlurmOptions, out: str | None, submit: bool) -> None:
    cfg = load_config(recipe, overrides)
    job = check_job(cfg, nodes, gpus, procs, grace_s, requeue=opts.requeue)
    opts.check(grace_s)
    script = Path(out) if out else Path(job.cfg.logging.out_dir) / "slurm" / f"{opts.job_name}.sbatch"
    output_file("--out", script)
    if submit:
        slurm_job.check_sbatch()
    check_inputs(job.cfg)
    slurm_job.write(job, opts, script, Path.cwd())
    typer.echo(f"wrote {script} ({job.nodes} nodes x {job.per_node} = {job.world} ranks; recipe "
               f"{script.with_suffix('.toml')}, logs {script.parent / 'logs'})")
    if submit:
        typer.echo(f"submitted job {slurm_job.submit(script)}")


@dataclass
class K8sOptions:
    image: str
    name: str = "tessel"
    namespace: str | None = None
    storage: str = "100Gi"
    storage_class: str | None = None
    pvc: str | None = None
    max_restarts: int = 3


def k8s(recipe: str, overrides: list[str], nodes: int, gpus: int | None, procs: int | None, grace_s: int,
        requeue: bool, opts: K8sOptions, out: str | None) -> None:
    """The manifest, printed or written to `out`. The recipe's data and weights must be where the pods see
    them (the image, or the volume): they are not checked here."""
    cfg = load_config(recipe, overrides)
    job = check_job(cfg, nodes, gpus, procs, grace_s, requeue=requeue)
    k8s_job.check_k8s_options(opts.name, opts.image, opts.namespace, opts.storage, opts.pvc, opts.max_restarts)
    if out:
        output_file("--out", out)
    text = k8s_job.to_yaml(k8s_job.manifest(job, opts.name, opts.image, opts.namespace, opts.storage,
                                            opts.storage_class, opts.pvc, opts.max_restarts))
    if out is None:
        typer.echo(text, nl=False)
        return
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(text)
    typer.echo(f"wrote {out}: a PyTorchJob of {job.nodes} pods x {job.per_node} = {job.world} ranks "
               f"(kubectl apply -f {out})")
