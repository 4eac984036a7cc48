"""Search: every layout that fits, ranked by predicted step time, and why the winner wins."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from tessel.planner.cost import CostModel, Estimate
from tessel.planner.layout import Layout

MICRO_BATCHES = (1, 2, 4, 8, 16, 32)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def tp_degrees(cfg, world: int) -> list[int]:
    """Tensor-parallel degrees tessel.config accepts for this model (ModelConfig) on `world` ranks."""
    return [t for t in divisors(world)
            if cfg.n_head % t == 0 and cfg.kv_heads % t == 0 and cfg.ffn_dim % t == 0]


def candidate_layouts(cm: CostModel, world: int, global_batch: int) -> list[Layout]:
    """All layouts tessel.config would accept for this model, world size and global batch."""
    c, seq = cm.spec.cfg, cm.spec.seq_len
    out = []
    tps = [t for t in tp_degrees(c, world) if t <= cm.cluster.devices_per_node]
    for tp in tps:
        for pp in (p for p in divisors(world // tp) if p <= c.n_layer):
            rest = world // (tp * pp)
            eps = [e for e in divisors(rest) if c.n_experts % e == 0] if c.n_experts else [1]
            for ep in eps:
                dp = rest // ep
                if global_batch % (dp * ep):
                    continue
                per_shard = global_batch // (dp * ep)
                for mb in (b for b in MICRO_BATCHES if per_shard % b == 0):
                    base = Layout(dp=dp, tp=tp, pp=pp, ep=ep, mb=mb)
                    out += _variants(base, per_shard // mb, c.n_layer, seq)
    return out


def _variants(base: Layout, chunks: int, n_layer: int, seq: int) -> list[Layout]:
    if base.pp == 1:
        pipes = [replace(base, m=1, ga=chunks)]
    else:
        pipes = [replace(base, m=chunks, schedule=s) for s in ("1f1b", "gpipe")]
        pipes += [replace(base, m=chunks, schedule="interleaved", v=v) for v in (2, 4)
                  if base.pp * v <= n_layer and chunks % base.pp == 0]
    zeros = (0, 1, 2, 3) if base.batch_shards > 1 else (0,)
    sps = (False, True) if base.tp > 1 and seq % base.tp == 0 else (False,)
    return [replace(p, zero=z, sp=sp, recompute=rc) for p in pipes for z in zeros for sp in sps
            for rc in (False, True)]


@dataclass
class SearchResult:
    ranked: list[Estimate]  # layouts that fit, fastest first
    evaluated: int
    rejected: list[Estimate]  # did not fit in memory, smallest footprint first

    @property
    def best(self) -> Estimate | None:
        return self.ranked[0] if self.ranked else None


def search(cm: CostModel, world: int, global_batch: int) -> SearchResult:
    estimates = [cm.estimate(lay) for lay in candidate_layouts(cm, world, global_batch)]
    fits = sorted((e for e in estimates if e.fits), key=lambda e: (e.step_s, e.memory_total))
    rejected = sorted((e for e in estimates if not e.fits), key=lambda e: e.memory_total)
    return SearchResult(fits, len(estimates), rejected)


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
