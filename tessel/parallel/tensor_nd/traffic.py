"""Bytes on the wire per layer for each tensor-parallel mode: the theory, and a recorder that measures it.

What a rank "sends" in one collective of b payload bytes over n ranks, under the bandwidth-optimal
algorithms (rings, pipelined chains): all-reduce 2(n-1)/n * b; all-gather and reduce-scatter
(n-1)/n * b of the whole (gathered / reduced) tensor; broadcast and reduce (n-1)/n * b averaged over
the group (a chain: every rank but one forwards b). These are the factors of DESIGN.md's busbw.

Per linear layer Y = X W, fwd + bwd, with X (N, K) the tokens x input features, W (K, M), e bytes per
element, per rank:

- 1D (Megatron, t ranks; for comparison): a column-parallel layer all-reduces dX backward, a row-parallel
  one Y forward: 2 (t-1)/t * N K * e or 2 (t-1)/t * N M * e, whatever t (not measured here).
- 2D (SUMMA, q x q; Xu et al. 2021): forward q broadcasts of X's and W's panels along rows and
  columns, backward q broadcast-multiply-reduce steps for dX and for dW:
  3 (q-1)/q^2 * (N K + K M) * e.
- 2.5D (Tesseract, q x q x d; Wang et al. 2021): SUMMA on the layer's N/d tokens, plus the depth
  all-reduce of dW: 3 (q-1)/q^2 * (N K / d + K M) * e + 2 (d-1)/d * K M / q^2 * e.
- 3D (c x c x c; Bian et al. 2021): all-gather X and W, reduce-scatter Y forward; all-gather dY and
  reduce-scatter dX and dW backward: 2 (c-1)/c^3 * (N K + K M + N M) * e.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from tessel.parallel.tensor import comm


def linear_bytes(mode: str, n: int, k: int, m: int, side: int, depth: int = 1, elem: int = 4) -> float:
    """Bytes one rank sends for one linear layer's forward and backward (see the module docstring)."""
    if mode == "2d":
        return 3 * (side - 1) / side ** 2 * (n * k + k * m) * elem
    if mode == "2.5d":
        return (3 * (side - 1) / side ** 2 * (n * k / depth + k * m) + 2 * (depth - 1) / depth * k * m / side ** 2) * elem
    if mode == "3d":
        return 2 * (side - 1) / side ** 3 * (n * k + k * m + n * m) * elem
    raise ValueError(f"no traffic model for tp_mode {mode!r}")


class CollectiveRecorder:
    """Counts the bytes this rank sends in torch.distributed collectives while `recording()` is open.

    A measuring tool (tests, benchmarks): for the duration it wraps the collectives tessel's tensor
    parallelism calls (torch.distributed's broadcast, reduce, all_reduce, and the single-tensor
    all-gather / reduce-scatter that tessel.parallel.tensor.comm bound at import) and restores them on exit.
    """

    def __init__(self):
        self.sent = 0.0
        self.calls: list[tuple[str, int, int]] = []  # (collective, payload bytes, group size)

    def _count(self, name: str, payload: torch.Tensor, group, factor: float) -> None:
        n = dist.get_world_size(group)
        b = payload.numel() * payload.element_size()
        self.calls.append((name, b, n))
        self.sent += factor * (n - 1) / n * b

    @contextlib.contextmanager
    def recording(self) -> Iterator[CollectiveRecorder]:
        saved = {name: getattr(dist, name) for name in ("broadcast", "reduce", "all_reduce")}
        gather, scatter = comm._all_gather_single, comm._reduce_scatter_single

        def wrap(name, fn, factor, payload_of):
            def recorded(*args, group=None, **kw):
                self._count(name, payload_of(args), group, factor)
                return fn(*args, group=group, **kw)
            return recorded

        def first(args):  # the payload argument of most collectives
            return args[0]

        try:
            dist.broadcast = wrap("broadcast", saved["broadcast"], 1, first)
            dist.reduce = wrap("reduce", saved["reduce"], 1, first)
            dist.all_reduce = wrap("all_reduce", saved["all_reduce"], 2, first)
            comm._all_gather_single = wrap("all_gather", gather, 1, first)  # (output, input): the whole
            comm._reduce_scatter_single = wrap("reduce_scatter", scatter, 1, lambda args: args[1])  # the input
            yield self
        finally:
            for name, fn in saved.items():
                setattr(dist, name, fn)
            comm._all_gather_single, comm._reduce_scatter_single = gather, scatter


# ---- the README's table: per layer, per rank, from the formulas above --------------------------

def grid_side(mode: str, devices: int, depth: int | None = None) -> tuple[int, int] | None:
    """(side, depth) of the grid `devices` ranks make in `mode`, or None (2D needs a square, 3D a cube;
    2.5D takes the depth that makes a cube of q x q x d with d = q when it can)."""
    if mode == "1d":
        return devices, 1
    if mode == "2d":
        q = round(devices ** 0.5)
        return (q, 1) if q * q == devices else None
    c = round(devices ** (1 / 3))
    if c ** 3 != devices:
        return None
    return (c, c) if mode == "2.5d" else (c, 1)


def layer_costs(mode: str, devices: int, tokens: int, hidden: int, elem: int = 2) -> dict[str, float] | None:
    """One transformer-sized linear (hidden x hidden on `tokens` tokens) in `mode` on `devices` ranks: bytes sent
    per rank (fwd + bwd), weight bytes and input-activation bytes per rank. None if the mode has no such grid."""
    grid = grid_side(mode, devices)
    if grid is None:
        return None
    side, depth = grid
    n, k, m = tokens, hidden, hidden
    if mode == "1d":  # a column + row pair halves: one all-reduce of N x H per layer fwd or bwd
        sent = 2 * (devices - 1) / devices * n * k * elem
        weights, acts = k * m / devices, n * k  # the activation is whole on every rank
    elif mode == "2.5d":
        sent = linear_bytes(mode, n, k, m, side, depth, elem)
        weights, acts = k * m / side ** 2, n * k / (depth * side ** 2)
    else:
        sent = linear_bytes(mode, n, k, m, side, depth, elem)
        cells = side ** 2 if mode == "2d" else side ** 3
        weights, acts = k * m / cells, n * k / cells
    return {"sent": sent, "weights": weights * elem, "acts": acts * elem}


def table(tokens: int = 8 * 2048, hidden: int = 12288, devices=(8, 64, 512)) -> str:
    """Markdown: per-layer bytes sent, weight and activation bytes per rank for each mode (bf16)."""
    mib = 2 ** 20
    rows = [f"| mode | {' | '.join(f'{d} devices: sent / weights / activations (MiB)' for d in devices)} |",
            "|---|" + "---|" * len(devices)]
    for mode in ("1d", "2d", "2.5d", "3d"):
        cells = []
        for d in devices:
            c = layer_costs(mode, d, tokens, hidden)
            cells.append("-" if c is None else f"{c['sent'] / mib:,.0f} / {c['weights'] / mib:,.1f} / {c['acts'] / mib:,.1f}")
        rows.append(f"| {mode} | {' | '.join(cells)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
