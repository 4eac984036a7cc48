"""The logic behind `tessel plan` and `tessel simulate` (tessel/commands/cli.py only parses arguments).

Here the measurement meets the cost model: for the cluster "this", tessel.calibrate probes this
machine and profiles the model, and the planner is handed the Cluster and Calibration it built.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tessel.config import Config, ConfigError, at_least, build_config, load_config, output_file, to_toml
from tessel.observe.progress import work_progress
from tessel.planner.cluster import Cluster, get_cluster, override
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.fabric import gain_lines, network_gains
from tessel.planner.gemm import source as gemm_source
from tessel.planner.grid_cost import grid_sizes
from tessel.planner.hetero import Gain, gain
from tessel.planner.layout import Layout, layout_config, layout_text, parse_fix, parse_layout
from tessel.planner.model_spec import ModelSpec, from_config, preset
from tessel.planner.search import MICRO_BATCHES, explain, plan_table, print_plan, search, simulated
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
    fixed: dict = field(default_factory=dict)  # --fix: layout fields the search keeps


@dataclass
class PlanOptions:
    """`tessel plan`'s own outputs: --tokens, --explain, --top, --out, --json."""
    top: int = 8
    out: str | None = None
    as_json: bool = False
    tokens: float | None = None  # tokens to train on: prints the days it takes
    explain: bool = False  # every term of the winner's step
    network: bool = False  # the search and simulation again with and without rails and SHARP


def check_plan_args(top: int, out: str | None, tokens: float | None = None, fix: str | None = None,
                    layout: str | None = None, network: bool = False, cluster: str = "a100") -> dict:
    """`tessel plan`'s own flags (resolve checks the ones it shares with simulate); returns --fix parsed."""
    at_least("--top", top, 1)
    if network and (layout is not None or cluster.lower() == "this"):
        raise ConfigError("--network", "compares the searches of a preset cluster's network variants; "
                          "not with --layout or --cluster this")
    if out is not None:
        output_file("--out", out)
    if tokens is not None and not (math.isfinite(tokens) and tokens >= 1):
        raise ConfigError("--tokens", f"must be a positive number of tokens (got {tokens:g})")
    if fix is None:
        return {}
    if layout is not None:
        raise ConfigError("--fix", "pins part of a searched layout; --layout gives the whole one")
    fixed = parse_fix(fix)
    if not fixed:
        raise ConfigError("--fix", "give key=value pairs, e.g. tp=8,recompute=selective")
    return fixed


def split_cluster_overrides(overrides: list[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """--set items: recipe fields, and cluster.<field>=value pairs (tessel.planner.cluster.override)."""
    recipe, cluster = [], []
    for item in overrides:
        key, eq, value = item.partition("=")
        if key.strip().startswith("cluster."):
            if not eq:
                raise ConfigError(key.strip(), "expected cluster.<field>=value")
            cluster.append((key.strip()[len("cluster."):], value.strip().strip('"')))
        else:
            recipe.append(item)
    return recipe, cluster


def with_overrides(cluster: Cluster, pairs: list[tuple[str, str]]) -> Cluster:
    for key, value in pairs:
        cluster = override(cluster, key, value)
    return cluster


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
    if precision is not None and precision not in ("fp32", "bf16", "fp8"):
        raise ConfigError("--precision", f"'{precision}' is not one of fp32, bf16, fp8")


def resolve(recipe: str | None, overrides: list[str], cluster: str, world: int | None, model: str | None,
            global_batch: int | None, precision: str | None, layout: str | None = None, calibrate: bool = True,
            refresh: bool = False, fixed: dict | None = None) -> Problem:
    """Recipe + flags -> the model, cluster and batch to plan for. ConfigError names any bad field.

    Everything the user gave is checked before the cluster "this" is measured (processes) or
    the model profiled on it (seconds)."""
    check_problem_args(cluster, world, model, global_batch, precision)
    overrides, cluster_set = split_cluster_overrides(overrides)
    checked = with_overrides(get_cluster("a100"), cluster_set)  # every key and value checked before any measuring
    if world is not None and checked.speeds and len(checked.speeds) != world:
        raise ConfigError("cluster.speeds", f"has {len(checked.speeds)} entries; give one per device ({world})")
    base, spec = _recipe_and_model(recipe, overrides, model, precision)
    gb = global_batch if global_batch is not None else spec.global_batch
    if world is None and recipe and not model:
        world = base.parallel.world_size
    if world is None:  # one node of a preset; this machine as a single rank
        world = 1 if cluster.lower() == "this" else get_cluster(cluster).world
    lay = checked_layout(base, world, gb, layout) if layout else None
    cl = with_overrides(cluster_named(cluster, world, refresh=refresh), cluster_set)
    if cl.speeds and len(cl.speeds) != world:
        raise ConfigError("cluster.speeds", f"has {len(cl.speeds)} entries; give one per device ({world})")
    cal = None
    if cl.name == "this" and calibrate:
        from tessel.calibrate.profile import profile_model  # deferred: loads torch and the trainer
        sizes = [b for b in MICRO_BATCHES if b <= gb]
        cal = profile_model(spec.cfg, spec.seq_len, world, sizes, base.train.precision, refresh=refresh)
    cm = CostModel(spec, cl, base.train.precision, cal, base.parallel.bucket_mb,
                   compiled=base.train.compile != "off", fused_loss=base.train.fused_loss)
    return Problem(base, spec, cl, world, gb, cm, lay, fixed or {})


class RecipeRules:
    """The layouts `tessel train` accepts for a recipe, and why it refuses the others.

    Each layout is written into the recipe (layout_config) and put through tessel.config's rules, the ones
    `tessel train` runs before it spawns anything: check_layout, with the Hugging Face family's checks in it
    (which axes a model type trains on, selective recompute, a grid's model types), the recipe's own choices
    (an asynchronous pipeline needs parallel.allow_async and no checkpoints; packed documents no pipeline, cp
    or grid). One source of truth: whatever `tessel plan` prints or writes with --out, `tessel train` takes.
    What the rules refuse is counted by its one line (`refusals`), for the plan's explanation."""

    def __init__(self, base: Config):
        self.base = base
        self.refused: Counter[str] = Counter()

    def __call__(self, lay: Layout) -> bool:
        try:
            layout_config(self.base, lay)
        except ConfigError as err:
            self.refused[str(err)] += 1
            return False
        return True

    def refusals(self, top: int = 3) -> list[str]:
        """How many layouts the rules took out, and their most frequent reasons, each with its count."""
        total = sum(self.refused.values())
        if not total:
            return []
        head = f"tessel train refuses {total} of the layouts for this recipe (not priced):"
        return [head] + [f"  {n} x {why}" for why, n in self.refused.most_common(top)]


def recipe_allows(base: Config) -> RecipeRules:
    """The filter the search takes (tessel.planner.search's `allow`): the recipe's rules (RecipeRules)."""
    return RecipeRules(base)


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


def plan(prob: Problem, opts: PlanOptions, console: Console | None = None) -> dict:
    console = console or Console(width=max(Console().width, 150))
    as_json, out, top = opts.as_json, opts.out, opts.top
    if prob.layout is not None:
        est = simulated([prob.cost.estimate(prob.layout)])[0]  # its flush priced as the search's leaders are
        ranked, lines = [est], _breakdown(est, prob.cluster)
    else:
        rules = recipe_allows(prob.base)
        try:
            with work_progress("pricing layouts") as work:
                result = search(prob.cost, prob.world, prob.global_batch, prob.fixed, progress=work.update,
                                allow=rules)
        except ConfigError as err:  # nothing left to price: say what the rules took out
            raise ConfigError(err.field, "; ".join([err.message] + rules.refusals())) from None
        ranked, lines = result.ranked[:top], explain(result, top) + rules.refusals()
        if not ranked:
            raise ConfigError("--fix" if prob.fixed else "--world", "; ".join(lines))
    winner = ranked[0]
    outputs = _throughput(winner, opts.tokens)
    hetero = _hetero(prob, winner)
    if hetero is not None:
        outputs.append(hetero.line())
    lines = lines + outputs
    terms = step_terms(winner) if opts.explain else []
    report = {"model": prob.spec.name, "params": prob.spec.total_params, "cluster": prob.cluster.name,
              "world": prob.world, "global_batch": prob.global_batch, "seq_len": prob.spec.seq_len,
              "fixed": prob.fixed, "plans": [e.to_json() for e in ranked], "explanation": lines,
              "model_tflops_per_device": winner.model_flops_per_device / 1e12,
              "model_tflops_per_device_with_recompute": winner.hardware_flops_per_device / 1e12,
              "gemms": gemm_source(prob.cluster)}
    if opts.tokens is not None:
        report["tokens"], report["days_to_train"] = opts.tokens, winner.days_to_train(opts.tokens)
    if opts.explain:
        report["step_terms"] = terms
    fabric = []
    if opts.network:
        rows = network_gains(prob.spec, prob.cluster, prob.world, prob.global_batch, prob.cost.precision,
                             fixed=prob.fixed)
        fabric = gain_lines(rows)
        report["network"] = [{"variant": r.variant, "layout": r.layout.describe(), "analytic_s": r.analytic_s,
                              "simulated_s": r.simulated_s, "baseline_layout_simulated_s": r.baseline_layout_s}
                             for r in rows]
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
            console.print("[dim]preset cluster: a device model whose every constant is cited in "
                          "tessel/planner/cluster.py (no training run fitted); override any with "
                          "--set cluster.<field>=value[/dim]")
            console.print(f"[dim]{gemm_source(prob.cluster)}[/dim]")
        if prob.layout is not None:
            console.print(plan_table(ranked, "predicted cost of the given layout"))
            for line in lines:
                console.print(line)
        else:
            print_plan(result, top, console)
            for line in rules.refusals():
                console.print(line)
            for line in outputs:
                console.print(line)
        if fabric:
            console.print("the network's features (each variant searched, its winner simulated):")
            for line in fabric:
                console.print("  " + line)
        if terms:
            console.print(f"the step of {winner.layout.describe()}, term by term:")
            for line in terms:
                console.print("  " + line)
        if out:
            console.print(f"wrote {out}: run it with `tessel train {out}`")
    return report


def _throughput(est: Estimate, tokens: float | None) -> list[str]:
    """Model TFLOP/s per device without and with the recomputed forwards, and the days to train."""
    with_recompute = est.mfu * est.hardware_flops_per_device / est.model_flops_per_device
    lines = [f"model TFLOP/s per device: {est.model_flops_per_device / 1e12:.1f} without recompute FLOPs "
             f"(MFU {100 * est.mfu:.1f}%), {est.hardware_flops_per_device / 1e12:.1f} with them counted "
             f"({100 * with_recompute:.1f}% of the peak)"]
    if tokens is not None:
        lines.append(f"time to train on {tokens:,.0f} tokens: {est.days_to_train(tokens):.1f} days "
                     f"({est.tokens_per_s:,.0f} tokens/s)")
    return lines


def step_terms(est: Estimate) -> list[str]:
    """Every term of an estimate's step: the critical path by cause (they sum to the step), what each
    link carries, the pipeline's pricing and the memory per device."""
    total = est.step_s
    out = [f"{name}: {v:.4g} s ({100 * v / total:.1f}%)" for name, v in est.time.items()]
    out.append(f"= step {total:.4g} s (critical path {est.path_s:.4g} s, busiest link bound "
               f"{est.link_bound_s:.4g} s)")
    out += [f"{link} busy {v:.4g} s per step ({100 * v / total:.1f}% of the step)" for link, v in est.links.items()]
    if est.layout.pp > 1:
        out.append(f"pipeline flush {est.flush_s:.4g} s x {est.layout.grad_accum} (priced by the {est.priced_by}), "
                   f"bubble {100 * est.bubble:.1f}%, p2p message {1e3 * est.p2p_s:.3g} ms")
    out += [f"{axis} sends {v / 1e9:.3g} GB per device per step" for axis, v in est.comm_bytes.items() if v > 0]
    out.append("memory per device: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in est.memory.items()
                                                if v > 0 and k != "total") + f" = {est.memory_total / 2**30:.2f} GiB")
    return out


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
        with work_progress("pricing layouts") as work:
            best = search(prob.cost, prob.world, prob.global_batch, progress=work.update,
                          allow=recipe_allows(prob.base)).best
        if best is None:
            raise ConfigError("--world", "no layout fits in memory; give one with --layout")
        est = best
    with work_progress("simulating") as work:
        result = simulate_plan(prob.cost, est.layout, est, progress=work.update)
    write_trace(result, trace)
    write_png(result, png, f"{est.layout.describe()}: simulated step {result.step_s:.4g} s, "
                           f"bubble {100 * result.bubble:.1f}%")
    report = {"layout": est.layout.to_dict(), "describe": est.layout.describe(), "simulated_step_s": result.step_s,
              "simulated_bubble": result.bubble, "analytic_step_s": est.step_s, "analytic_bubble": est.bubble,
              "events": len(result.events), "trace": trace, "png": png,
              "note": "one representative pipeline stands for all dp*ep replicas and tp ranks (symmetry)"}
    hetero = _hetero(prob, est)
    if hetero is not None:
        report["heterogeneous"] = hetero.to_json()
    if as_json:
        print(json.dumps(report, indent=1))
    else:
        Console().print(f"{est.layout.describe()} on {prob.world} x {prob.cluster.name}: simulated step "
                        f"{result.step_s:.4g} s (analytic {est.step_s:.4g} s), bubble {100 * result.bubble:.1f}% "
                        f"(analytic {100 * est.bubble:.1f}%), {len(result.events)} events\n"
                        f"trace: {trace}\ntimeline: {png}")
        if hetero is not None:
            Console().print(hetero.line())
    return report


def _hetero(prob: Problem, est: Estimate) -> Gain | None:
    """cluster.speeds: the layout's step split evenly and in proportion to speed (tessel.planner.hetero)."""
    return gain(est, list(prob.cluster.speeds), prob.spec.cfg.n_layer) if prob.cluster.speeds else None


# ---- tessel simulate --tp-modes: 1D, 2D, 2.5D and 3D at each tensor-parallel group size ----------------

TP_MODES = ("1d", "2d", "2.5d", "3d")


def check_tp_modes_arg(text: str | None, layout: str | None) -> list[int]:
    """--tp-modes 8,64,512: the tp group sizes to compare the modes at (each a positive integer)."""
    if text is None:
        return []
    if layout is not None:
        raise ConfigError("--tp-modes", "searches each mode's best layout at each group size; not with --layout")
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise ConfigError("--tp-modes", f"'{text}' is not a comma-separated list of group sizes") from None
    if not sizes or min(sizes) < 2:
        raise ConfigError("--tp-modes", f"give tp group sizes >= 2, e.g. 8,64,512 (got '{text}')")
    return sizes


def tp_mode_rows(prob: Problem, sizes: list[int]) -> list[dict]:
    """For each tp group size and mode: the fastest layout the search finds with tp and tp_mode pinned (the rest
    searched), its step simulated event by event; or why there is none."""
    rows = []
    for size in sizes:
        for mode in TP_MODES:
            row = {"tp": size, "mode": mode}
            try:
                best = search(prob.cost, prob.world, prob.global_batch, {"tp": size, "tp_mode": mode},
                              allow=recipe_allows(prob.base)).best
            except ConfigError:
                rows.append({**row, "why": _no_layout(prob.spec.cfg, mode, size)})
                continue
            if best is None:
                rows.append({**row, "why": "out of memory"})
                continue
            sim = simulate_plan(prob.cost, best.layout, best)
            rows.append({**row, "layout": layout_text(best.layout), "describe": best.layout.describe(),
                         "simulated_step_s": sim.step_s, "analytic_step_s": best.step_s,
                         "tp_comm_share": best.time["tp+ep comm"] / best.step_s,
                         "memory_gib": best.memory_total / 2**30})
        timed = [r for r in rows if r["tp"] == size and "simulated_step_s" in r]
        if timed:
            min(timed, key=lambda r: r["simulated_step_s"])["wins"] = True
    return rows


def _no_layout(cfg, mode: str, size: int) -> str:
    """Why no layout has a tp group of `size` ranks in `mode` (tessel.config's rules)."""
    if mode == "1d":
        for name, value in (("n_head", cfg.n_head), ("n_kv_head", cfg.kv_heads), ("d_ff", cfg.ffn_dim)):
            if value % size:
                return f"{name} ({value}) does not split {size} ways"
    grids = {m for m, tp, _ in grid_sizes(size) if tp == size}
    if mode != "1d" and mode not in grids:
        return {"2d": f"{size} is no q x q grid", "2.5d": f"{size} is no q x q x d grid (2 <= d <= q)",
                "3d": f"{size} is no c x c x c cube"}[mode]
    return "no micro-batch, stage count or model width fits it"


def simulate_tp_modes(prob: Problem, sizes: list[int], as_json: bool) -> dict:
    """`tessel simulate --tp-modes`: which tensor-parallel mode wins at which group size on this cluster."""
    rows = tp_mode_rows(prob, sizes)
    inter = prob.cluster.inter
    report = {"model": prob.spec.name, "cluster": prob.cluster.name, "world": prob.world,
              "global_batch": prob.global_batch, "inter_gbps": inter.bandwidth / 1e9,
              "intra_gbps": prob.cluster.intra.bandwidth / 1e9, "rows": rows}
    if as_json:
        print(json.dumps(report, indent=1))
        return report
    console = Console(width=max(Console().width, 150))
    console.print(f"{prob.spec.name} on {prob.world} x {prob.cluster.name} (NVLink "
                  f"{prob.cluster.intra.bandwidth / 1e9:g} GB/s, network {inter.bandwidth / 1e9:g} GB/s per GPU), "
                  f"global batch {prob.global_batch}: each "
                  "mode's fastest layout at each tp group size, its step simulated")
    table = Table()
    for col in ("tp", "mode", "simulated s", "analytic s", "tp comm", "memory GiB", "layout"):
        table.add_column(col, justify="left" if col in ("mode", "layout") else "right", no_wrap=True)
    for r in rows:
        if "why" in r:
            table.add_row(str(r["tp"]), r["mode"], "-", "-", "-", "-", r["why"])
            continue
        table.add_row(str(r["tp"]), r["mode"] + (" *" if r.get("wins") else ""), f"{r['simulated_step_s']:.3g}",
                      f"{r['analytic_step_s']:.3g}", f"{100 * r['tp_comm_share']:.0f}%", f"{r['memory_gib']:.1f}",
                      r["describe"])
    console.print(table)
    console.print("* the fastest mode at that group size; each row again: tessel simulate (same flags) --layout ...")
    for r in rows:
        if "layout" in r:
            console.print(f"  tp {r['tp']} {r['mode']}: --layout {r['layout']}", soft_wrap=True)
    return report
