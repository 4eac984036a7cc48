"""What the network's features are worth: the same search and simulation with and without rails and SHARP.

The network model (tessel.planner.network) prices rail-optimised nodes
(hierarchical collectives, 1/k of the data on each GPU's own rail) and SHARP
(switches reduce: each node sends and receives the all-reduce data once). Here
each combination is a variant of one cluster: the search picks its own winner
on each, and the event simulator (tessel.planner.simulate.simulate_plan)
replays both that winner and the baseline's winner on it, so a row says what
the feature gains and whether it changes the chosen layout (`tessel plan
--network`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessel.planner.cluster import Cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout
from tessel.planner.model_spec import ModelSpec
from tessel.planner.search import search
from tessel.planner.simulate import simulate_plan

# PXN needs rails (it routes through the rail-aligned GPU), so it goes with them
VARIANTS = {"rails + SHARP": {"rails": True, "pxn": True, "sharp": True},
            "rails": {"rails": True, "pxn": True, "sharp": False},
            "no rails + SHARP": {"rails": False, "pxn": False, "sharp": True},
            "no rails": {"rails": False, "pxn": False, "sharp": False}}


@dataclass
class FabricRow:
    variant: str
    layout: Layout  # the search's winner on this network
    analytic_s: float
    simulated_s: float  # the winner's step, simulated on this network
    baseline_layout_s: float  # the baseline network's winner, simulated on this network


def network_gains(spec: ModelSpec, cluster: Cluster, world: int, global_batch: int, precision: str = "bf16",
                  baseline: str = "no rails", fixed: dict | None = None) -> list[FabricRow]:
    """One row per network variant of `cluster` (VARIANTS), the `baseline` one's winner replayed on all."""
    winners = {}
    for name, flags in VARIANTS.items():
        cm = CostModel(spec, replace(cluster, **flags), precision)
        best = search(cm, world, global_batch, fixed).best
        if best is None:
            raise ValueError(f"no layout fits on {name}")
        winners[name] = (cm, best)
    base_layout = winners[baseline][1].layout
    rows = []
    for name, (cm, best) in winners.items():
        simulated = simulate_plan(cm, best.layout).step_s
        same = simulated if best.layout == base_layout else simulate_plan(cm, base_layout).step_s
        rows.append(FabricRow(name, best.layout, best.step_s, simulated, same))
    return rows


def gain_lines(rows: list[FabricRow], baseline: str = "no rails") -> list[str]:
    """The rows as sentences: each variant's winner and simulated step against the baseline's."""
    base = next(r for r in rows if r.variant == baseline)
    out = [(f"baseline ({baseline}): {base.layout.describe()}, simulated step {base.simulated_s:.4g} s "
            f"(analytic {base.analytic_s:.4g} s)")]
    for r in rows:
        if r is base:
            continue
        change = ("the same layout" if r.layout == base.layout
                  else f"chooses {r.layout.describe()} instead ({base.layout.describe()} would take "
                       f"{r.baseline_layout_s:.4g} s here)")
        out.append(f"{r.variant}: simulated step {r.simulated_s:.4g} s (analytic {r.analytic_s:.4g} s), "
                   f"{100 * (base.simulated_s / r.simulated_s - 1):+.1f}% throughput over {baseline}; {change}")
    return out
