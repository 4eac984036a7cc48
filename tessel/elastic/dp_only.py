"""Re-planning the layout when the world size changes (torchrun --nnodes MIN:MAX, or a smaller restart).

The rule is the simplest correct one: keep tp, pp, ep and cp (they fix how the
model and its sequences are cut, and a checkpoint loads into any cut anyway) and give the
remaining factor to dp. The global batch is kept: gradient accumulation takes
up the difference, so each rank's micro-batch stays as it was where it can.
Because the BatchSampler's batch for a step depends on the step alone, the
run continues on the same trajectory (up to the summation order of the
gradient reduction). fault.replan = "full" chooses the whole layout again
instead (tessel.elastic.replan); both print the same report (Replanned): the layout
before and after, the step time the previous attempt measured, the one the
planner predicts, and, once the new layout has run a few steps, its own.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tessel.config import Config, ConfigError, check_layout
from tessel.planner.layout import Layout, config_layout


def replan(cfg: Config, world_size: int) -> Config:
    """A copy of cfg laid out for `world_size` ranks (cfg itself if it already fits)."""
    p, t = cfg.parallel, cfg.train
    if p.world_size == world_size:
        return cfg
    fixed = p.pp * p.tp * p.ep * p.cp
    if world_size % fixed:
        raise ConfigError("parallel", f"cannot re-plan for {world_size} ranks: pp*tp*ep*cp = {fixed} does not "
                                      "divide it")
    dp = world_size // fixed
    # sequences per micro-batch on one rank, before the change
    micro = t.global_batch // (p.dp * p.ep * t.grad_accum * p.micro_batches)
    split = dp * p.ep * p.micro_batches
    if t.global_batch % split:
        raise ConfigError("train.global_batch", f"({t.global_batch}) cannot be split over dp={dp} after "
                          f"re-planning for {world_size} ranks")
    per_rank = t.global_batch // split  # sequences per rank per micro-batch slot and step
    # the old micro-batch if it divides the new share, else the whole share at once
    accum = per_rank // micro if per_rank % micro == 0 and per_rank >= micro else 1
    new = cfg.model_copy(deep=True)
    new.parallel.dp = dp
    new.parallel.dp_shares = None  # an uneven split was for the old ranks (dp_split = "speed" splits again)
    new.train.grad_accum = accum
    new.runtime.nproc_per_node = None
    check_layout(new, world_size=world_size)
    return new


def describe_change(old: Config, new: Config) -> str:
    return (f"[tessel elastic] world {old.parallel.world_size} -> {new.parallel.world_size}: "
            f"dp {old.parallel.dp} -> {new.parallel.dp}, grad_accum {old.train.grad_accum} -> "
            f"{new.train.grad_accum}, global batch {new.train.global_batch} kept")


def replan_for_world(cfg: Config, world_size: int, rank: int = 0,
                     run_id: str | None = None) -> tuple[Config, Replanned | None]:
    """fault.replan = "dp-only": the re-divided config, and its report (None where nothing changed)."""
    new = replan(cfg, world_size)
    if new is cfg:
        return cfg, None
    report = Replanned("dp-only", previous_attempt(cfg, run_id) if rank == 0 else Previous(0, ""), world_size,
                       described_layout(new))
    if rank == 0:
        print(describe_change(cfg, new), flush=True)
        print("\n".join(report.lines()), flush=True)
    return new, report


# ---- the report ----------------------------------------------------------------------------------
MEASURE_STEPS = 3  # steady steps of the new layout its measured step time is the median of


def described_layout(cfg: Config) -> str:
    return config_layout(cfg).describe()


@dataclass
class Previous:
    """The layout the run had before this re-plan and what it measured (the recipe's, where nothing ran)."""
    world: int
    layout: str
    resume_step: int | None = None  # the checkpoint the new layout continues from
    step_s: float | None = None  # median step time of the previous attempt's last steps
    steps: tuple[int, int] | None = None  # the steps that median is over


@dataclass
class Replanned:
    """A re-plan, reported: old and new layouts, predicted and measured step times (rank 0 prints it)."""
    mode: str  # "dp-only" | "full"
    old: Previous
    world: int
    layout: str
    predicted_s: float | None = None  # the planner's step time of the new layout
    alternative: str | None = None  # under "full": the layout dp-only would have run ...
    alternative_s: float | None = None  # ... and its predicted step time
    notes: list[str] = field(default_factory=list)  # how the choice was made: links, devices, profile
    times: list[tuple[int, float]] = field(default_factory=list)  # (step, step_time_s) of the new layout
    reported: bool = False

    def lines(self) -> list[str]:
        o = self.old
        measured = (f"measured {o.step_s:.4g} s/step (steps {o.steps[0]}-{o.steps[1]})" if o.step_s is not None
                    else "no steps measured")
        where = f", resumes at step {o.resume_step}" if o.resume_step is not None else ""
        out = [f"[tessel replan] {self.mode}: world {o.world} -> {self.world}{where}",
               f"  old  {o.layout:<34} {o.world} ranks, {measured}"]
        if self.alternative is not None:
            out.append(f"  dp-only would run {self.alternative}: " + _predicted(self.alternative_s))
        out.append(f"  new  {self.layout:<34} {self.world} ranks, " + _predicted(self.predicted_s))
        return out + [f"  {note}" for note in self.notes]

    def observe(self, step: int, row: dict) -> None:
        """The new layout's steps: after a warm-up step, MEASURE_STEPS of them are reported once."""
        if "step_time_s" not in row or self.reported:
            return
        self.times.append((step, row["step_time_s"]))
        if len(self.times) == MEASURE_STEPS + 1:
            self.finish()

    def finish(self) -> None:
        """Report the steps measured so far (the run ended before MEASURE_STEPS), once."""
        steady = self.times[1:] or self.times
        if self.reported or not steady:
            return
        self.reported = True
        median = statistics.median(t for _, t in steady)
        vs = (f" (predicted {self.predicted_s:.4g} s, {100 * (median / self.predicted_s - 1):+.0f}%)"
              if self.predicted_s else "")
        old = f"; before: {self.old.step_s:.4g} s on {self.old.world} ranks" if self.old.step_s is not None else ""
        print(f"[tessel replan] {self.layout} on {self.world} ranks: measured {median:.4g} s/step over steps "
              f"{steady[0][0]}-{steady[-1][0]}{vs}{old}", file=sys.stderr, flush=True)


def _predicted(seconds: float | None) -> str:
    return f"predicted {seconds:.4g} s/step" if seconds is not None else "not predicted (fault.replan = 'full' does)"


def manifest_layout(manifest: dict) -> Layout:
    """The layout a checkpoint was saved under (its manifest's parallel fields and grad_accum)."""
    p, ga = manifest["layout"], manifest["layout"].get("grad_accum", 1)
    shards = p.get("dp", 1) * p.get("ep", 1)
    mb = max(1, manifest["global_batch"] // (shards * ga * p.get("micro_batches", 1)))
    return Layout(dp=p.get("dp", 1), tp=p.get("tp", 1), pp=p.get("pp", 1), ep=p.get("ep", 1),
                  zero_stage=p.get("zero_stage", 0), micro_batch=mb, micro_batches=p.get("micro_batches", 1),
                  grad_accum=ga,
                  schedule=p.get("schedule", "1f1b"), virtual_stages=p.get("virtual_stages", 1),
                  sequence_parallel=p.get("sequence_parallel", False), recompute=p.get("recompute", "none"))


def previous_attempt(cfg: Config, run_id: str | None) -> Previous:
    """What ran before: the layout of the checkpoint this run resumes from (the recipe's where there is
    none) and the median step time its attempt measured over its last steps (metrics.jsonl)."""
    from tessel.train.checkpoint.manager import latest_valid, run_model  # deferred: loads torch (DCP)
    from tessel.train.checkpoint.manifest import CheckpointError, read_manifest  # deferred: the same
    found = None
    resume = cfg.checkpoint.resume
    try:
        if resume == "auto":
            root = Path(cfg.checkpoint.dir or Path(cfg.logging.out_dir) / "checkpoints")
            found = latest_valid(root, log=lambda _msg: None, model=run_model(cfg), run_id=run_id)
        elif resume is not None:
            found = (Path(resume), read_manifest(Path(resume)))
    except (OSError, CheckpointError):
        found = None
    if found is None:
        return Previous(cfg.parallel.world_size, described_layout(cfg))
    manifest = found[1]
    step = int(manifest["step"])
    old = Previous(int(manifest["world_size"]), manifest_layout(manifest).describe(), step)
    old.step_s, old.steps = _measured_before(Path(cfg.logging.out_dir) / "metrics.jsonl", step)
    return old


def _measured_before(path: Path, step: int, last: int = 8) -> tuple[float | None, tuple[int, int] | None]:
    """Median step_time_s of the last `last` steps before `step` in a metrics file (None if none)."""
    try:
        rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None, None
    by_step = {r["step"]: r["step_time_s"] for r in rows if "step_time_s" in r and r.get("step", step) < step}
    steps = sorted(by_step)[-last:]
    if not steps:
        return None, None
    return statistics.median(by_step[s] for s in steps), (steps[0], steps[-1])
