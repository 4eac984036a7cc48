"""Heterogeneous devices: who does how much when ranks run at different speeds, and what it gains.

Two splits, both exact in their math (the same global batch, the same update):

- dp: each dp rank runs a number of a step's micro-batches in proportion to
  its speed (`dp_shares`); its loss is weighted by its share of the tokens
  (tessel.parallel.data.uneven), so the averaged gradient is the even split's.
  A dp rank is a whole replica: its speed is its slowest tp rank's.
- pp: each stage holds a number of blocks in proportion to its speed, within
  its memory (`pp_layout`); a stage's speed is its slowest rank's.

Both are makespan problems solved greedily, one unit at a time to whoever
would finish it first, which is optimal for identical units. `gain` prices
even and uneven from a cost-model estimate of the layout on speed-1 devices
(tessel.planner.cost): the dp split scales each rank's compute, the pipeline's
flush is replayed by the event simulator (tessel.planner.simulate) with each
stage's chunk times scaled by its speed and its blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

from tessel.axes import AXES
from tessel.config import Config, ConfigError, build_config
from tessel.planner.cost import Estimate
from tessel.planner.memory import layer_activation_bytes
from tessel.planner.model_spec import from_config
from tessel.planner.pricing.pipeline import chunk_layers, peak_chunks_in_flight
from tessel.planner.simulate import simulate_pipeline


AXIS_ORDER = tuple(AXES)  # the mesh's default rank order, outermost first (parallel.rank_order)


def proportional_shares(speeds: list[float], total: int, capacity: list[int] | None = None) -> list[int]:
    """`total` identical units over workers of these speeds, at least one each and at most capacity[i]:
    each unit to the worker that would finish it first (ties: the lower index)."""
    n = len(speeds)
    if total < n:
        raise ConfigError("parallel", f"{total} units cannot give each of {n} workers one")
    cap = capacity or [total] * n
    if sum(cap) < total or min(cap) < 1:
        raise ConfigError("runtime.device_memory_gib", f"the devices hold at most {sum(cap)} of {total} blocks")
    shares = [1] * n
    for _ in range(total - n):
        open_ = [i for i in range(n) if shares[i] < cap[i]]
        shares[min(open_, key=lambda i: ((shares[i] + 1) / speeds[i], i))] += 1
    return shares


def min_per_coord(speeds: list[float], sizes: dict[str, int], order: list[str], axis: str) -> list[float]:
    """Per coordinate along `axis` (a dp replica, a pipeline stage), the smallest of its ranks' values (the
    slowest speed, the least memory), the mesh's rank order (outermost first) mapping ranks to coordinates."""
    out: dict[int, float] = {}
    for rank, s in enumerate(speeds):
        coord = _coord(rank, sizes, order, axis)
        out[coord] = min(out.get(coord, s), s)
    return [out[c] for c in range(sizes[axis])]


def with_speeds(cfg: Config, speeds: list[float], layer_capacity: list[int] | None = None) -> Config:
    """cfg with parallel.dp_split / pp_balance = "speed" resolved for ranks of these speeds: dp_shares and
    pp_layout written in (layer_capacity: the most blocks each stage's memory holds)."""
    p = cfg.parallel
    raw = cfg.model_dump()
    if p.dp_split == "speed":
        units = p.dp * cfg.train.grad_accum * p.micro_batches
        raw["parallel"]["dp_shares"] = proportional_shares(min_per_coord(speeds, p.axis_sizes, p.rank_order, "dp"),
                                                           units)
    if p.pp_balance == "speed" and p.pp > 1 and p.pp_layout is None:
        if p.virtual_stages > 1:
            raise ConfigError("parallel.pp_balance", "'speed' cuts one chunk per stage (virtual_stages = 1)")
        raw["parallel"]["pp_layout"] = proportional_shares(min_per_coord(speeds, p.axis_sizes, p.rank_order, "pp"),
                                                           cfg.model.n_layer, layer_capacity)
    return build_config(raw)


def rebalanced(cfg: Config, forward_s: list[float]) -> tuple[Config | None, str]:
    """cfg with the work shared again in proportion to the speeds the ranks showed (their work over their
    forward seconds, per rank in rank order): the dp shares, or the pipeline's blocks; (None, why) where
    the layout has neither to move, or the split stays as it is."""
    p = cfg.parallel
    order = list(p.rank_order)
    if p.pp > 1 and p.virtual_stages == 1:
        cut = p.pp_layout or [len(c) for c in chunk_layers(cfg.model.n_layer, p.pp, 1)]
        stage = min_per_coord([cut[_coord(r, p.axis_sizes, order, "pp")] / max(t, 1e-9)
                               for r, t in enumerate(forward_s)], p.axis_sizes, order, "pp")
        new = proportional_shares(stage, cfg.model.n_layer)
        if new == cut:
            return None, f"blocks per stage {cut} are already in proportion"
        raw = cfg.model_dump()
        raw["parallel"]["pp_layout"] = new
        return build_config(raw), f"blocks per stage {cut} -> {new}"
    if p.dp > 1 and p.pp == 1 and p.ep == 1 and cfg.model.n_experts == 0 and p.zero_stage <= 1:
        units = p.dp * cfg.train.grad_accum * p.micro_batches
        shares = p.dp_shares or [units // p.dp] * p.dp
        speeds = min_per_coord([shares[_coord(r, p.axis_sizes, order, "dp")] / max(t, 1e-9)
                                for r, t in enumerate(forward_s)], p.axis_sizes, order, "dp")
        new = proportional_shares(speeds, units)
        if new == shares:
            return None, f"micro-batches per dp rank {shares} are already in proportion"
        raw = cfg.model_dump()
        raw["parallel"]["dp_shares"] = new
        return build_config(raw), f"micro-batches per dp rank {shares} -> {new}"
    return None, "the layout has no dp share (plain dp or ZeRO-1, pp = 1) or pipeline cut (v = 1) to move"


def _coord(rank: int, sizes: dict[str, int], order: list[str], axis: str) -> int:
    stride = 1
    for a in reversed(order):
        if a == axis:
            return rank // stride % sizes[a]
        stride *= sizes[a]
    raise ValueError(axis)


def layer_capacity(cfg: Config, stage_memory: list[float], baseline: float = 0.0) -> list[int]:
    """The most blocks each pipeline stage's memory (bytes per rank) holds: a block's parameters, gradients
    and AdamW state (16 bytes a parameter, over tp) and the activations of the micro-batches the schedule
    keeps in flight on that stage; the embedding (first) and head (last) and `baseline` come off first."""
    p, t = cfg.parallel, cfg.train
    spec = from_config(cfg.model, t.seq_len, t.global_batch)
    mb = max(1, t.global_batch // (p.batch_shards * t.grad_accum * p.micro_batches))
    block = 16 * max(sum(spec.layer_params(i)) for i in range(cfg.model.n_layer)) / p.tp
    act = layer_activation_bytes(spec, mb * t.seq_len, p.tp, p.sequence_parallel, t.precision)
    out = []
    for s, mem in enumerate(stage_memory):
        edges = 16 * ((spec.embedding_params if s == 0 else 0) + (spec.head_params if s == p.pp - 1 else 0)) / p.tp
        in_flight = peak_chunks_in_flight(p.schedule, p.pp, p.micro_batches, s)
        out.append(max(1, int((mem - baseline - edges) // (block + in_flight * act))))
    return out


# ---- what it gains ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Gain:
    even_s: float  # the layout's step on these devices, split evenly
    uneven_s: float  # ... split in proportion to speed
    split: list[int]  # dp shares (micro-batches per dp rank) or pp layout (blocks per stage)
    what: str  # "dp" | "pp"

    @property
    def speedup(self) -> float:
        return self.even_s / self.uneven_s

    def to_json(self) -> dict:
        return {"even_step_s": self.even_s, "uneven_step_s": self.uneven_s, "speedup": self.speedup,
                "split": self.split, "axis": self.what}

    def line(self) -> str:
        kind = "micro-batches per dp rank" if self.what == "dp" else "blocks per stage"
        return (f"heterogeneous devices: even split {self.even_s:.4g} s/step, in proportion to speed "
                f"{self.uneven_s:.4g} s/step ({self.speedup:.2f}x; {kind} {self.split})")


def gain(est: Estimate, speeds: list[float], n_layer: int) -> Gain | None:
    """Even vs uneven split of est's layout on devices of these relative speeds (speed 1: the devices est
    was priced on); None where neither split applies (all one speed, or dp = pp = 1)."""
    lay = est.layout
    if len(set(speeds)) <= 1 or (lay.pp == 1 and (lay.dp == 1 or lay.ep > 1)):
        return None
    return priced(est, speeds, n_layer)


def priced(est: Estimate, speeds: list[float], n_layer: int, capacity: list[int] | None = None,
           order: list[str] | tuple[str, ...] = AXIS_ORDER) -> Gain:
    """est's layout on devices of these relative speeds (speed 1: the device est was priced on; rank order,
    the mesh's `order`), split evenly and in proportion to speed: a pipeline's blocks per stage (within
    `capacity`, the most blocks each stage's memory holds), else the dp ranks' micro-batches. Where the
    layout has no such split (dp = 1, experts, virtual stages) both prices are the even split's. Whether
    the runtime runs the uneven split of a layout is tessel.config's to say (dp_split, pp_balance)."""
    lay = est.layout
    if lay.pp > 1:
        return _pipeline_gain(est, min_per_coord(speeds, lay.axis_sizes, list(order), "pp"), n_layer, capacity)
    return _dp_gain(est, min_per_coord(speeds, lay.axis_sizes, list(order), "dp"), split=lay.ep == 1)


def _dp_gain(est: Estimate, speeds: list[float], split: bool = True) -> Gain:
    f, b = est.chunk_times[0][0]
    per_mb = f + b  # one micro-batch's forward and backward on a speed-1 device
    k = est.layout.chunks  # micro-batches per dp rank, even
    shares = proportional_shares(speeds, k * len(speeds)) if split else [k] * len(speeds)
    rest = est.step_s - k * per_mb  # communication, optimizer, overhead: the same either way
    even = rest + max(k * per_mb / s for s in speeds)
    uneven = rest + max(n * per_mb / s for n, s in zip(shares, speeds))
    return Gain(even, uneven, shares, "dp")


def _pipeline_gain(est: Estimate, speeds: list[float], n_layer: int, capacity: list[int] | None = None) -> Gain:
    """The flush replayed with each stage's chunk times scaled by its blocks and speed."""
    lay = est.layout
    rest = est.step_s - lay.grad_accum * est.flush_s
    even_layers = [len(c) for c in chunk_layers(n_layer, lay.pp, 1)]
    if lay.virtual_stages > 1:  # a stage's chunks all run at its speed; the cut moves one chunk per stage only (v = 1)
        times = [[(f / s, b / s) for f, b in row] for row, s in zip(est.chunk_times, speeds)]
        flush_s = simulate_pipeline(times, lay.schedule, lay.micro_batches, lay.virtual_stages).step_s
        even = rest + lay.grad_accum * flush_s
        return Gain(even, even, even_layers, "pp")
    layers = proportional_shares(speeds, n_layer, capacity)
    per_block = [(f / n, b / n) for (f, b), n in zip((row[0] for row in est.chunk_times), even_layers)]
    mean = (sum(f for f, _ in per_block) / lay.pp, sum(b for _, b in per_block) / lay.pp)

    def flush(cut: list[int]) -> float:
        times = [[(mean[0] * n / s, mean[1] * n / s)] for n, s in zip(cut, speeds)]
        return simulate_pipeline(times, lay.schedule, lay.micro_batches).step_s
    return Gain(rest + lay.grad_accum * flush(even_layers), rest + lay.grad_accum * flush(layers), layers, "pp")
