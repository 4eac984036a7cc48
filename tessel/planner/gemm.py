"""A GEMM's seconds on a GPU: a roofline prior from the device model, corrected by measured tables.

The prior (`prior_seconds`) is first principles on the constants of tessel.planner.cluster,
none fitted to a training run:

- Compute: the output is cut into tiles that run in waves over the SMs (tile and wave
  quantization, NVIDIA's Matrix Multiplication Background User's Guide, ch. 3); a tile too
  small to feed its SM from L2 runs slower; each wave waits for its tiles' load pipeline to
  fill, in K-steps of the main loop, except on a GPU whose kernels are persistent (Hopper:
  the next tile's loads overlap the last one's epilogue), where only the first wave waits.
  The library takes the best of its tile shapes.
- Split-K: a GEMM with few output tiles and a long K (the weight gradient of a tp-sharded
  layer: M = its output features / tp, N = d_model, K = the tokens) would leave most SMs
  idle; cuBLAS then splits K into s slices computed by separate tiles and sums their fp32
  partials (cublasLt's split-K reduction schemes). Each slice pays its own pipeline fill and
  the partials cost 2 s M N x 4 bytes of HBM traffic, so splitting only pays where the waves
  were mostly empty. Without it the prior priced a tp = 8 weight gradient such as
  96 x 768 x 16384 at 0.08 of the peak (24 tiles on 132 SMs); split, it fills one wave: 0.26.
- Memory: nothing runs faster than HBM streams its operands and result (Williams et al.
  2009's roofline).

A measured table (`GemmTable`: shapes timed by benchmarks/gpu_suite.py's matmul section on
one GPU, stored in tessel/planner/gemm_tables/<preset>.json with the GPU, date and command)
grounds the level: each measured shape's time over the prior's is a correction; a shape in the
table costs what was measured, any other the prior times the corrections of its nearest measured
shapes (in log M, log N, log K, log batch), weighted by inverse squared distance. The prior
keeps the shape dependence where nothing was measured. `source` says which one priced a cluster.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 128), (64, 64))  # cuBLAS's Ampere tile shapes
MAX_SPLIT = 16  # the most K slices the prior tries (an assumption, not a cuBLAS figure: 16 fill 132 SMs from 9 tiles)
NEIGHBOURS = 4  # measured shapes whose corrections a shape outside the table takes
TABLES = Path(__file__).parent / "gemm_tables"


@dataclass(frozen=True)
class Gemm:
    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k * self.batch


@dataclass(frozen=True)
class GemmTable:
    """Seconds of GEMMs measured on one GPU (bf16 operands, fp32 accumulation), and where they came from."""
    gpu: str  # the device's name as torch reports it
    date: str
    command: str
    points: tuple[tuple[Gemm, float], ...]  # (shape, median seconds)
    dtype: str = "bf16"
    torch: str = ""

    def to_dict(self) -> dict:
        return {"gpu": self.gpu, "date": self.date, "command": self.command, "dtype": self.dtype,
                "torch": self.torch,
                "points": [{"m": g.m, "n": g.n, "k": g.k, "batch": g.batch, "seconds": s} for g, s in self.points]}

    @staticmethod
    def from_dict(d: dict) -> "GemmTable":
        points = tuple((Gemm(p["m"], p["n"], p["k"], p.get("batch", 1)), float(p["seconds"])) for p in d["points"])
        return GemmTable(d["gpu"], d["date"], d["command"], points, d.get("dtype", "bf16"), d.get("torch", ""))


def load_table(preset: str, folder: Path = TABLES) -> GemmTable | None:
    """The measured table of a preset's GPU, if one was committed (tessel/planner/gemm_tables/<preset>.json)."""
    path = folder / f"{preset}.json"
    if not path.exists():
        return None
    return GemmTable.from_dict(json.loads(path.read_text()))


def source(cl) -> str:
    """One line: what prices this cluster's GEMMs."""
    t = cl.gemm_table
    if cl.sms <= 0:
        return "GEMMs: no device model (a flat share of the peak, or this machine's profile)"
    if t is None:
        return (f"GEMMs: the roofline prior of tessel/planner/gemm.py (no measured table for {cl.name}; "
                f"benchmarks/gpu_suite.py writes one)")
    return f"GEMMs: measured on {t.gpu} ({t.date}, {len(t.points)} shapes, `{t.command}`), the prior between them"


def gemm_seconds(g: Gemm, cl, dtype: str) -> float:
    """One GEMM (or `batch` of them): measured where the cluster's table covers its dtype, the prior otherwise."""
    t = cl.gemm_table
    if t is not None and (t.dtype != dtype or not t.points):
        t = None
    return _seconds(g, _device(cl, dtype), t)


@dataclass(frozen=True)
class _Device:
    """The fields of a Cluster a GEMM's price reads (hashable, so prices are memoised: the search asks for
    the same few shapes thousands of times)."""
    peak: float
    sms: int
    efficiency: float
    tile_feed: float
    k_overhead: float
    persistent: bool
    hbm: float
    elt: int


def _device(cl, dtype: str) -> _Device:
    return _Device(cl.peak_flops[dtype], cl.sms, cl.gemm_efficiency, cl.gemm_tile_feed, cl.gemm_k_overhead,
                   cl.gemm_persistent, cl.mem_bandwidth * cl.hbm_efficiency, {"fp8": 1, "bf16": 2}.get(dtype, 4))


@lru_cache(maxsize=65536)
def _seconds(g: Gemm, dev: _Device, table: GemmTable | None) -> float:
    prior = _prior(g, dev)
    return prior if table is None else prior * _correction(g, table, dev)


def correction(g: Gemm, t: GemmTable, cl) -> float:
    """measured / prior at g: exact where g was measured, else the weighted geometric mean of its nearest."""
    return _correction(g, t, _device(cl, t.dtype))


def _correction(g: Gemm, t: GemmTable, dev: _Device) -> float:
    near = sorted(((_distance(g, p), p, s) for p, s in t.points), key=lambda x: x[0])[:NEIGHBOURS]
    if near[0][0] == 0.0:
        _, p, s = near[0]
        return s / _prior(p, dev)
    weights = [1 / d ** 2 for d, _, _ in near]
    logs = [math.log(s / _prior(p, dev)) for _, p, s in near]
    return math.exp(sum(w * x for w, x in zip(weights, logs)) / sum(weights))


def _distance(a: Gemm, b: Gemm) -> float:
    return math.sqrt(sum(math.log(x / y) ** 2 for x, y in ((a.m, b.m), (a.n, b.n), (a.k, b.k), (a.batch, b.batch))))


def prior_seconds(g: Gemm, cl, dtype: str) -> float:
    """The best tile and split-K over the SMs at the sustained share of the peak, never faster than HBM."""
    return _prior(g, _device(cl, dtype))


@lru_cache(maxsize=65536)
def _prior(g: Gemm, dev: _Device) -> float:
    per_sm = dev.peak / dev.sms * dev.efficiency
    best = math.inf
    for tm, tn in TILES:
        out_tiles = math.ceil(g.m / tm) * math.ceil(g.n / tn) * g.batch
        feed = tm * tn / (tm + tn)  # MACs per operand element loaded
        rate = per_sm * (min(1.0, feed / dev.tile_feed) if dev.tile_feed else 1.0)
        for split in range(1, MAX_SPLIT + 1):
            if split > 1 and out_tiles >= dev.sms:  # the waves are full: splitting K only adds traffic
                break
            k = math.ceil(g.k / split)
            waves = math.ceil(out_tiles * split / dev.sms)
            fills = 1 if dev.persistent else waves  # pipeline fills each SM waits for
            seconds = 2 * tm * tn * (waves * k + fills * dev.k_overhead) / rate
            if split > 1:  # each slice's fp32 partial written, then read by the reduction
                seconds += 2 * split * g.m * g.n * 4 * g.batch / dev.hbm
            best = min(best, seconds)
    traffic = (g.m * g.k + g.k * g.n + g.m * g.n) * dev.elt * g.batch
    return max(best, traffic / dev.hbm)


def efficiency(g: Gemm, cl, dtype: str) -> float:
    """The share of the dense peak a GEMM reaches as the planner prices it."""
    return g.flops / gemm_seconds(g, cl, dtype) / cl.peak_flops[dtype]
