"""Search: every layout that fits, ranked by predicted step time, and why the winner wins."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from rich.console import Console
from rich.table import Table

from tessel.config import ConfigError, tp_grid_refusal
from tessel.parallel.pipeline.async_schedules import ASYNC_SCHEDULES
from tessel.planner.cluster import Link
from tessel.planner.cost import CostModel, Estimate
from tessel.planner.grid_cost import grid_of, grid_sizes
from tessel.planner.layout import Layout
from tessel.planner.simulate import simulate_pipeline

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)
# context parallelism splits sequences from this length on (a bound on the search, as MICRO_BATCHES is):
# below it a micro-batch's activations fit beside tp, pp and recompute on any preset, and cp only adds
# traffic; `--fix cp=N` prices it at any length
CP_MIN_SEQ = 8192
RECOMPUTE = ("none", "selective", "full")
# the closed form of a flush is exact for even stages; uneven ones (a remainder of layers, the LM
# head) can be off by 10-20% (tests/planner/test_pipeline_pricing.py), so the pipelined layouts
# within SIMULATE_MARGIN of the best are re-priced by the event simulator, at most SIMULATE_TOP flushes
SIMULATE_TOP = 12
SIMULATE_MARGIN = 0.15


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(cfg, world: int) -> list[int]:
    """Tensor-parallel degrees tessel.config accepts for this model (ModelConfig) on `world` ranks."""
    return [t for t in divisors(world)
            if cfg.n_head % t == 0 and cfg.kv_heads % t == 0 and cfg.ffn_dim % t == 0]


# the pipeline schedules the search tries. ZB-H2 prices as ZB-H1's bubble with more memory (a step ends in a
# synchronous update, tessel.parallel.pipeline.zero_bubble), PipeDream as 2BW's time with more weight versions:
# neither can win, so they are priced only when --fix names them. Asynchronous ones (stale weights) only
# where `allow` is given and allows them (tessel.commands.planning.recipe_allows: the recipe's parallel.allow_async).
SEARCHED = ("1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "2bw")


def candidate_layouts(cm: CostModel, world: int, global_batch: int, fixed: dict | None = None,
                      allow: Callable[[Layout], bool] | None = None) -> list[Layout]:
    """All layouts tessel.config would accept for this model, world size and global batch; with
    `fixed` (tessel.planner.layout.parse_fix), only those with these fields; with `allow`, only those it
    allows (a recipe's own rules: tessel.commands.planning.recipe_allows)."""
    # 1D inside a node, or as wide as a pinned tp; the grids at any size (their groups cross nodes by design),
    # on a device model: a probed machine's fits hold no broadcast or reduce (SUMMA's), so there only if pinned
    tp_cap = max(cm.cluster.devices_per_node, (fixed or {}).get("tp", 0))
    grids = cm.cluster.source == "preset" or (fixed or {}).get("tp_mode", "1d") != "1d"
    schedules = tuple(s for s in SEARCHED if allow is not None or s not in ASYNC_SCHEDULES)
    if fixed and "schedule" in fixed:
        schedules = (fixed["schedule"],) if allow is not None or fixed["schedule"] not in ASYNC_SCHEDULES else ()
    every = _all_layouts(cm, world, global_batch, tp_cap, (fixed or {}).get("cp"), schedules)
    every += grid_layouts(cm, world, global_batch) if grids else []  # cp = 1: cp with a grid is refused
    if allow is not None:
        every = [lay for lay in every if allow(lay)]
    if not fixed:
        return every
    if fixed.get("zero_param_dtype") == "bf16":  # ZeRO's bf16 storage, where the runtime allows it
        every = [replace(lay, zero_param_dtype="bf16") for lay in every if lay.zero_stage >= 1 and lay.pp == 1]
    return [lay for lay in every if all(getattr(lay, k) == v for k, v in fixed.items())]


def cp_degrees(cm: CostModel, world: int, tp: int, fixed: int | None = None) -> list[int]:
    """Context-parallel degrees tessel.config accepts beside `tp` (the sequence in 2*cp chunks), inside a node
    with tp; cp > 1 only for long sequences (CP_MIN_SEQ) unless `fixed`, and for dense models (the search keeps
    an MoE model at cp = 1: the cost model does not price its routing exchanges over cp)."""
    c, seq = cm.spec.cfg, cm.spec.seq_len
    if fixed is not None:
        return [fixed] if world % (tp * fixed) == 0 and seq % (2 * fixed) == 0 else []
    if seq < CP_MIN_SEQ or cm.spec.n_experts:
        return [1]
    return [k for k in divisors(world // tp) if k == 1 or (k * tp <= cm.cluster.devices_per_node and seq % (2 * k) == 0)]


def _all_layouts(cm: CostModel, world: int, global_batch: int, tp_cap: int | None = None,
                 fixed_cp: int | None = None, schedules: tuple[str, ...] = SEARCHED) -> list[Layout]:
    c, seq = cm.spec.cfg, cm.spec.seq_len
    out = []
    tps = [t for t in tp_degrees(c, world) if t <= (tp_cap or cm.cluster.devices_per_node)]
    for tp, cp in ((t, k) for t in tps for k in cp_degrees(cm, world, t, fixed_cp)):
        for pp in (p for p in divisors(world // (tp * cp)) if p <= c.n_layer):
            rest = world // (tp * cp * pp)
            experts = cm.spec.n_experts
            eps = [e for e in divisors(rest) if experts % e == 0] if experts else [1]
            for ep in eps:
                dp = rest // ep
                if global_batch % (dp * ep):
                    continue
                per_shard = global_batch // (dp * ep)
                for mb in (b for b in MICRO_BATCHES if per_shard % b == 0):
                    base = Layout(dp=dp, tp=tp, pp=pp, ep=ep, micro_batch=mb, cp=cp)
                    out += [replace(v, cp_mode=mode)
                            for v in _variants(base, per_shard // mb, c.n_layer, seq, schedules)
                            for mode in _cp_modes(c, tp, cp)]
    return out


def _cp_modes(cfg, tp: int, cp: int) -> tuple[str, ...]:
    """ring always; Ulysses where each tp rank's heads and kv heads split over cp."""
    if cp == 1:
        return ("ring",)
    return ("ring", "ulysses") if (cfg.n_head // tp) % cp == 0 and (cfg.kv_heads // tp) % cp == 0 else ("ring",)


def _variants(base: Layout, chunks: int, n_layer: int, seq: int,
              schedules: tuple[str, ...] = ("1f1b", "gpipe", "interleaved")) -> list[Layout]:
    if base.pp == 1:
        pipes = [replace(base, micro_batches=1, grad_accum=chunks)]
    else:
        pipes = [replace(base, micro_batches=chunks, schedule=s) for s in ("1f1b", "gpipe") if s in schedules]
        pipes += [replace(base, micro_batches=chunks, schedule="interleaved", virtual_stages=v) for v in (2, 4)
                  if "interleaved" in schedules and base.pp * v <= n_layer and chunks % base.pp == 0]
        pipes += _zero_bubble_pipes(base, chunks, n_layer, schedules)
    zeros = (0, 1, 2, 3) if base.token_shards > 1 else (0,)
    sps = (False, True) if base.tp > 1 and seq % (base.tp * base.cp) == 0 else (False,)
    # a split backward's W would rebuild a fully recomputed block once per weight group: tessel.config
    # refuses the pairing
    out = [replace(p, zero_stage=z, sequence_parallel=sp, recompute=rc) for p in pipes for z in zeros for sp in sps
           for rc in RECOMPUTE if not (rc == "full" and p.schedule in ("zb-h1", "zb-h2", "zbv"))]
    if base.pp > 1 and base.tp == 1 and base.ep == 1 and base.cp == 1 and chunks >= base.pp:
        # asynchronous pipelines compose with pp and dp so far: no ZeRO, tp, cp, ep or recompute (tessel.config)
        out += [replace(base, micro_batches=chunks, schedule=s) for s in ASYNC_SCHEDULES if s in schedules]
    return out


def _zero_bubble_pipes(base: Layout, chunks: int, n_layer: int, schedules: tuple[str, ...]) -> list[Layout]:
    """ZB-H1, ZB-H2 (one stage a rank) and ZBV (two, in a V, with at least pp micro-batches), as tessel.config
    takes them: 1D tensor parallelism, no context or expert parallelism."""
    if base.tp_mode != "1d" or base.cp > 1 or base.ep > 1:
        return []
    pipes = [replace(base, micro_batches=chunks, schedule=s) for s in ("zb-h1", "zb-h2") if s in schedules]
    if "zbv" in schedules and 2 * base.pp <= n_layer and chunks >= base.pp:
        pipes.append(replace(base, micro_batches=chunks, schedule="zbv", virtual_stages=2))
    return pipes


def grid_layouts(cm: CostModel, world: int, global_batch: int) -> list[Layout]:
    """Layouts whose tp group is a 2D, 2.5D or 3D grid (tessel.parallel.tensor_nd), by tessel.config's rules:
    the model's (tp_grid_refusal: the grid's sizes, what its side divides, each micro-batch over the grid's
    batch chunks) and the compositions it refuses (sequence parallelism, ZeRO-3 with a pipeline, experts: ep = 1)."""
    c, seq = cm.spec.cfg, cm.spec.seq_len
    if cm.spec.n_experts:  # the grid's pricing (grid_cost) knows dense blocks; an MoE block it computes whole is not
        return []
    out = []
    for mode, tp, depth in grid_sizes(world):
        for pp in (p for p in divisors(world // tp) if p <= c.n_layer):
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_shard = global_batch // dp
            for mb in grid_micro_batches(per_shard, mode, tp, depth):
                if tp_grid_refusal(c, mode, tp, depth, mb, pp) is not None:
                    continue
                base = Layout(dp=dp, tp=tp, pp=pp, micro_batch=mb, tp_mode=mode, tp_depth=depth)
                out += [lay for lay in _variants(base, per_shard // mb, c.n_layer, seq)
                        if not lay.sequence_parallel and (lay.zero_stage <= 2 or lay.pp == 1)]
    return out


def grid_micro_batches(per_shard: int, mode: str, tp: int, depth: int) -> list[int]:
    """Micro-batch sizes a grid can take: the search's, and 1, 2 or 4 sequences for each of the grid's batch
    chunks (a 512-rank cube splits each micro-batch 64 ways)."""
    chunks = grid_of(mode, tp, depth).batch_chunks
    sizes = set(MICRO_BATCHES) | {chunks * b for b in (1, 2, 4)}
    return sorted(b for b in sizes if per_shard % b == 0 and b % chunks == 0)


@dataclass
class SearchResult:
    ranked: list[Estimate]  # layouts that fit, fastest first
    evaluated: int
    rejected: list[Estimate]  # did not fit in memory, smallest footprint first

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def search(cm: CostModel, world: int, global_batch: int, fixed: dict | None = None,
           simulate_top: int = SIMULATE_TOP, progress: Callable[[int, int], None] | None = None,
           allow: Callable[[Layout], bool] | None = None) -> SearchResult:
    """Every layout that fits, fastest first: priced by the cost model, the leading pipelined ones
    re-priced by the event simulator (one pricing of schedules: the runtime's own action lists).
    progress(done, total) hears of each layout priced (a bar in tessel.commands.planning). Asynchronous pipelines
    are candidates only under an `allow` that keeps them (the recipe's parallel.allow_async)."""
    layouts = candidate_layouts(cm, world, global_batch, fixed, allow)
    if not layouts:
        pinned = ",".join(f"{k}={v}" for k, v in (fixed or {}).items())
        bf16 = (fixed or {}).get("zero_param_dtype") == "bf16"
        why = " (bf16 parameter storage needs zero >= 1 and pp = 1)" if bf16 else ""
        if (fixed or {}).get("schedule") in ASYNC_SCHEDULES:
            why = " (asynchronous schedules update on stale weights: the recipe needs parallel.allow_async = true)"
        raise ConfigError("--fix", f"no layout of {world} devices at global batch {global_batch} has {pinned}{why}")
    estimates = []
    for lay in layouts:
        estimates.append(cm.estimate(lay))
        if progress is not None:
            progress(len(estimates), len(layouts))
    fits = sorted((e for e in estimates if e.fits), key=_rank)
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total)
    return SearchResult(simulated(fits, simulate_top), len(estimates), rejected)


def _rank(e: Estimate) -> tuple[float, float]:
    return e.step_s, e.memory_total


def simulated(ranked: list[Estimate], top: int = SIMULATE_TOP, margin: float = SIMULATE_MARGIN) -> list[Estimate]:
    """`ranked` with the pipeline flushes of its leading pipelined layouts (within `margin` of the
    fastest, `top` distinct flushes at most) priced by the event simulator, re-sorted."""
    if not ranked or top <= 0:
        return ranked
    bound = ranked[0].step_s * (1 + margin)
    memo: dict = {}
    out = []
    for e in ranked:
        lay = e.layout
        if lay.pp > 1 and e.step_s <= bound:
            key = (tuple(map(tuple, e.chunk_times)), lay.schedule, lay.micro_batches, lay.virtual_stages, e.p2p_s)
            if key not in memo and len(memo) < top:
                memo[key] = simulated_flush(e)
            if key in memo:
                e = e.repriced(memo[key])
        out.append(e)
    return sorted(out, key=_rank)


def simulated_flush(e: Estimate) -> float:
    """One flush of e's pipeline replayed by the simulator from the runtime's action lists, each
    message a delay of the cost model's p2p time (no bandwidth sharing: the formula's assumption)."""
    lay = e.layout
    instant = Link(1e30, e.p2p_s)  # a finite rate: a message lasts its latency
    return simulate_pipeline(e.chunk_times, lay.schedule, lay.micro_batches, lay.virtual_stages,
                             1.0 if e.p2p_s else 0.0, instant).step_s


# ---- explanation -----------------------------------------------------------------

def _gib(x: float) -> str:
    return f"{x / 2**30:.1f} GiB" if x >= 2**30 else f"{x / 2**20:.0f} MiB"


def plan_table(estimates: list[Estimate], title: str) -> Table:
    table = Table(title=title)
    for col in ("#", "layout", "step s", "tokens/s", "MFU", "bubble", "memory", "params", "grads", "optim", "activ"):
        table.add_column(col, justify="left" if col == "layout" else "right", no_wrap=True)
    for i, e in enumerate(estimates, 1):
        m = e.memory
        table.add_row(str(i), e.layout.describe(), f"{e.step_s:.3g}", f"{e.tokens_per_s:,.0f}",
                      f"{100 * e.mfu:.1f}%", f"{100 * e.bubble:.1f}%", _gib(m["total"]), _gib(m["params"]),
                      _gib(m["grads"]), _gib(m["optimizer"]), _gib(m["activations"]))
    return table


def explain(result: SearchResult, top: int = 5) -> list[str]:
    """Sentences on why the winner wins: its time budget, and what each runner-up pays more for."""
    best = result.best
    if best is None:
        lines = [f"no layout out of {result.evaluated} fits in memory"]
        if result.rejected:
            e = result.rejected[0]
            lines.append(f"the smallest footprint is {e.layout.describe()} needing {_gib(e.memory_total)} per device")
        return lines
    total = best.step_s
    parts = ", ".join(f"{k} {100 * v / total:.0f}%" for k, v in sorted(best.time.items(), key=lambda kv: -kv[1])
                      if v / total >= 0.01)
    lines = [f"winner {best.layout.describe()}: {best.step_s:.3g} s/step, {100 * best.mfu:.1f}% MFU, "
             f"{_gib(best.memory_total)}/device; its step is {parts}"]
    if best.placement:
        lines.append("placement (tp innermost): " + ", ".join(f"{a} groups on {where}-node links"
                                                            for a, where in best.placement.items()))
    for i, e in enumerate(result.ranked[1:top], 2):
        deltas = {k: e.time.get(k, 0.0) - best.time.get(k, 0.0) for k in e.time}
        worst = max(deltas, key=deltas.get)
        lines.append(f"#{i} {e.layout.describe()} is {100 * (e.step_s / total - 1):.1f}% slower, "
                     f"mostly {worst} (+{deltas[worst]:.3g} s)")
    lines.append(f"{result.evaluated} layouts evaluated, {len(result.ranked)} fit, "
                 f"{len(result.rejected)} exceed the memory per device")
    faster_oom = [e for e in result.rejected if e.step_s < best.step_s]
    if faster_oom:
        e = min(faster_oom, key=lambda x: x.step_s)
        lines.append(f"faster but out of memory: {e.layout.describe()} ({e.step_s:.3g} s) needs "
                     f"{_gib(e.memory_total)} per device")
    return lines


def print_plan(result: SearchResult, top: int = 5, console: Console | None = None) -> None:
    console = console or Console(width=max(Console().width, 150))
    console.print(plan_table(result.ranked[:top], "predicted step time (fastest first)"))
    for line in explain(result, top):
        console.print(line)
