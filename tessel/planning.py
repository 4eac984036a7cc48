"""The logic behind `tessel plan` and `tessel simulate` (tessel/cli.py only parses arguments).

Here the measurement meets the cost model: for the cluster "this", tessel.calibrate probes this
machine and profiles the model, and the planner is handed the Cluster and Calibration it built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console

from tessel.config import Config, ConfigError, at_least, build_config, load_config, output_file, to_toml
from tessel.planner.cluster import Cluster, get_cluster
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.layout import Layout, layout_config, parse_layout
from tessel.planner.model_spec import ModelSpec, from_config, preset
from tessel.planner.search import MICRO_BATCHES, explain, plan_table, print_plan, search
from tessel.planner.simulate import simulate_plan, write_png, write_trace


@dataclass
class Problem:
    base: Config  # the recipe the plan's layout is written into
    spec: ModelSpec
    cluster: Cluster
    world: int
    global_batch: int
    cost: CostModel
    layout: Layout | None = None  # --layout, checked against the recipe's rules; None: search


def check_plan_args(top: int, out: str | None) -> None:
    """`tessel plan`'s own flags (resolve checks the ones it shares with simulate)."""
    at_least("--top", top, 1)
    if out is not None:
        output_file("--out", out)


def check_simulate_args(trace: str, png: str) -> None:
    output_file("--trace", trace)
    output_file("--png", png)


def check_problem_args(cluster: str, world: int | None, model: str | None, global_batch: int | None,
                       precision: str | None) -> None:
    """The flags plan and simulate share, checked before a recipe is read or a machine measured."""
    at_least("--world", world, 1)
    at_least("--global-batch", global_batch, 1)
    if cluster.lower() != "this":  # a preset costs nothing to build, and building it checks the name and --world
        get_cluster(cluster, world)
    if model is not None:
        preset(model)
    if precision is not None and precision not in ("fp32", "bf16"):
        raise ConfigError("--precision", f"'{precision}' is not one of fp32, bf16")


def resolve(recipe: str | None, overrides: list[str], cluster: str, world: int | None, model: str | None,
            global_batch: int | None, precision: str | None, layout: str | None = None, calibrate: bool = True,
            refresh: bool = False) -> Problem:
    """Recipe + flags -> the model, cluster and batch to plan for. ConfigError names any bad field.

    Everything the user gave is checked before the cluster "this" is measured (processes) or
    the model profiled on it (seconds)."""
    check_problem_args(cluster, world, model, global_batch, precision)
    base, spec = _recipe_and_model(recipe, overrides, model, precision)
    gb = global_batch if global_batch is not None else spec.global_batch
    if world is None and recipe and not model:
        world = base.parallel.world_size
    if world is None:  # one node of a preset; this machine as a single rank
        world = 1 if cluster.lower() == "this" else get_cluster(cluster).world
    lay = checked_layout(base, world, gb, layout) if layout else None
    cl = cluster_named(cluster, world, refresh=refresh)
    cal = None
    if cl.name == "this" and calibrate:
        from tessel.calibrate.profile import profile_model  # deferred: loads torch and the trainer
        sizes = [b for b in MICRO_BATCHES if b <= gb]
        cal = profile_model(spec.cfg, spec.seq_len, world, sizes, base.train.precision, refresh=refresh)
    cm = CostModel(spec, cl, base.train.precision, cal, base.parallel.bucket_mb)
    return Problem(base, spec, cl, world, gb, cm, lay)


def cluster_named(name: str, world: int | None = None, refresh: bool = False) -> Cluster:
    """A preset by name (sized to `world` devices), or "this": this machine at `world` ranks, probed
    by tessel.calibrate (cached; refresh re-measures)."""
    if name.lower() != "this":
        return get_cluster(name, world)
    from tessel.calibrate.profile import probe_this  # deferred: loads torch and the trainer
    return probe_this(world or 1, refresh=refresh)


def _recipe_and_model(recipe: str | None, overrides: list[str], model: str | None,
                      precision: str | None) -> tuple[Config, ModelSpec]:
    """The recipe (or the defaults) with --model's preset and --precision written in."""
    base = load_config(recipe, overrides) if recipe else build_config({}, overrides)
    if model:
        spec = preset(model)
        raw = base.model_dump(exclude_none=True)
        raw["model"] = spec.cfg.model_dump(exclude_none=True)
        raw["train"]["seq_len"] = spec.seq_len
        raw["parallel"] = {}
        raw["train"]["global_batch"], raw["train"]["grad_accum"] = spec.global_batch, 1
        if precision is None and not recipe:
            raw["train"]["precision"] = "bf16"
        base = build_config(raw)
    else:
        spec = from_config(base.model, base.train.seq_len, base.train.global_batch,
                           name=Path(recipe).stem if recipe else "default")
    if precision:
        base = build_config({**base.model_dump(exclude_none=True), "train": {
            **base.train.model_dump(), "precision": precision}})
    return base, spec


def checked_layout(base: Config, world: int, global_batch: int, text: str) -> Layout:
    """Parse --layout and run it through tessel.config's rules (errors name the field)."""
    lay = parse_layout(text, global_batch)
    if lay.world != world:
        raise ConfigError("--layout", f"dp*tp*pp*ep = {lay.world} but --world is {world}")
    if lay.global_batch != global_batch:
        raise ConfigError("--layout", f"mb*m*ga*dp*ep = {lay.global_batch} but the global batch is "
                          f"{global_batch}")
    layout_config(base, lay)
    return lay


def plan(prob: Problem, as_json: bool, out: str | None, top: int, console: Console | None = None) -> dict:
    console = console or Console(width=max(Console().width, 150))
    if prob.layout is not None:
        est = prob.cost.estimate(prob.layout)
        ranked, lines = [est], _breakdown(est, prob.cluster)
    else:
        result = search(prob.cost, prob.world, prob.global_batch)
        ranked, lines = result.ranked[:top], explain(result, top)
        if not ranked:
            raise ConfigError("--world", " ".join(lines))
    report = {"model": prob.spec.name, "params": prob.spec.total_params, "cluster": prob.cluster.name,
              "world": prob.world, "global_batch": prob.global_batch, "seq_len": prob.spec.seq_len,
              "plans": [e.to_json() for e in ranked], "explanation": lines}
    if out:
        cfg = layout_config(prob.base, ranked[0].layout)
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(to_toml(cfg))
        report["recipe"] = out
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        head = (f"{prob.spec.name} ({prob.spec.total_params / 1e9:.3g}B params) on {prob.world} x "
                f"{prob.cluster.name}, global batch {prob.global_batch} x {prob.spec.seq_len} tokens")
        console.print(head)
        if prob.cluster.source == "preset":
            console.print("[dim]preset cluster: compute priced at the spec-sheet peak (nothing measured), so "
                          "step times are lower bounds; the ranking is what to read[/dim]")
        if prob.layout is not None:
            console.print(plan_table(ranked, "predicted cost of the given layout"))
            for line in lines:
                console.print(line)
        else:
            print_plan(result, top, console)
        if out:
            console.print(f"wrote {out}: run it with `tessel train {out}`")
    return report


def _breakdown(est: Estimate, cluster: Cluster) -> list[str]:
    total = est.step_s
    parts = ", ".join(f"{k} {v:.3g} s ({100 * v / total:.0f}%)" for k, v in est.time.items() if v > 0)
    mem = ", ".join(f"{k} {v / 2**20:,.0f} MiB" for k, v in est.memory.items() if v > 0)
    fit = "fits" if est.fits else "does NOT fit"
    return [f"step {total:.4g} s: {parts}", f"memory per device: {mem}; {fit} in "
            f"{cluster.memory * cluster.usable_memory / 2**30:.1f} GiB usable"]


def simulate(prob: Problem, trace: str, png: str, as_json: bool) -> dict:
    if prob.layout is not None:
        est = prob.cost.estimate(prob.layout)
    else:
        best = search(prob.cost, prob.world, prob.global_batch).best
        if best is None:
            raise ConfigError("--world", "no layout fits in memory; give one with --layout")
        est = best
    result = simulate_plan(prob.cost, est.layout, est)
    write_trace(result, trace)
    write_png(result, png, f"{est.layout.describe()}: simulated step {result.step_s:.4g} s, "
                           f"bubble {100 * result.bubble:.1f}%")
    report = {"layout": est.layout.to_dict(), "describe": est.layout.describe(), "simulated_step_s": result.step_s,
              "simulated_bubble": result.bubble, "analytic_step_s": est.step_s, "analytic_bubble": est.bubble,
              "events": len(result.events), "trace": trace, "png": png,
              "note": "one representative pipeline stands for all dp*ep replicas and tp ranks (symmetry)"}
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        Console().print(f"{est.layout.describe()} on {prob.world} x {prob.cluster.name}: simulated step "
                        f"{result.step_s:.4g} s (analytic {est.step_s:.4g} s), bubble {100 * result.bubble:.1f}% "
                        f"(analytic {100 * est.bubble:.1f}%), {len(result.events)} events\n"
                        f"trace: {trace}\ntimeline: {png}")
    return report

