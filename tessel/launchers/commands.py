"""The logic of `tessel launch slurm` and `tessel launch k8s`: check everything, then write (and submit)."""

from __future__ import annotations

from pathlib import Path

import typer

from tessel.config import load_config, output_file
from tessel.launchers import slurm as slurm_job
from tessel.launchers.job import check_inputs, check_job


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
