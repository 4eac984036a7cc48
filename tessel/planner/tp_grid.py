"""Tensor parallelism in 1D, 2D, 2.5D and 3D per linear layer: bytes sent, weight and activation bytes per
rank, and a time at a link's bandwidth and latency. Pure arithmetic, no torch: the runtime's collectives are
recorded against linear_bytes in tests/parallel/tensor_nd (tessel.testing.grid_traffic).

What a rank "sends" in one collective of b payload bytes over n ranks, under the bandwidth-optimal
algorithms (rings, pipelined chains): all-reduce 2(n-1)/n * b; all-gather and reduce-scatter
(n-1)/n * b of the whole (gathered / reduced) tensor; broadcast and reduce (n-1)/n * b averaged over
the group (a chain: every rank but one forwards b). These are the factors of nccl-tests' bus bandwidth (busbw).

Per linear layer Y = X W, fwd + bwd, with X (N, K) the tokens x input features, W (K, M), e bytes per
element, per rank:

- 1D (Megatron, t ranks; for comparison): a column-parallel layer all-reduces dX backward, a row-parallel
  one Y forward: 2 (t-1)/t * N K * e (one all-reduce of N x H per layer on average), whatever t.
- 2D (SUMMA, q x q; Xu et al. 2021): forward q broadcasts of X's and W's panels along rows and
  columns, backward q broadcast-multiply-reduce steps for dX and for dW:
  3 (q-1)/q^2 * (N K + K M) * e, in 6q collectives over q ranks.
- 2.5D (Tesseract, q x q x d; Wang et al. 2021): SUMMA on the layer's N/d tokens, plus the depth
  all-reduce of dW: 3 (q-1)/q^2 * (N K / d + K M) * e + 2 (d-1)/d * K M / q^2 * e.
- 3D (c x c x c; Bian et al. 2021): all-gather X and W, reduce-scatter Y forward; all-gather dY and
  reduce-scatter dX and dW backward: 2 (c-1)/c^3 * (N K + K M + N M) * e, in 6 collectives over c ranks.
"""

from __future__ import annotations

from tessel.planner.traffic import Call

MODES = ("1d", "2d", "2.5d", "3d")
STREAM, MIXED = (2, 1), (1, 2)  # 3D: the layouts L(s, r) a linear reads (tessel.parallel.tensor_nd.cube)


def linear_bytes(mode: str, n: int, k: int, m: int, side: int, depth: int = 1, elem: int = 4) -> float:
    """Bytes one rank sends for one linear layer's forward and backward (see the module docstring)."""
    if mode == "2d":
        return 3 * (side - 1) / side ** 2 * (n * k + k * m) * elem
    if mode == "2.5d":
        summa = 3 * (side - 1) / side ** 2 * (n * k / depth + k * m)
        return (summa + 2 * (depth - 1) / depth * k * m / side ** 2) * elem
    if mode == "3d":
        return 2 * (side - 1) / side ** 3 * (n * k + k * m + n * m) * elem
    raise ValueError(f"no traffic model for tp_mode {mode!r}")


Calls = list[tuple[int, Call]]  # (grid dimension the collective runs along, the call)


def linear_calls(mode: str, n: int, k: int, m: int, side: int, depth: int = 1, elem: int = 4,
                 layout: tuple[int, int] = STREAM) -> tuple[Calls, Calls]:
    """(forward, backward) collectives of one linear layer, call by call, each along a dimension of the grid
    (tessel.parallel.tensor_nd.grid's: (i, j) for 2D, (depth, i, j) for 2.5D, (a, b, e) for 3D; the row group
    varies j, the column group i). Sizes by tessel.planner.traffic's convention; what they send adds up to
    linear_bytes (tests/planner/test_tp_grid.py), the runtime's calls are recorded against them in
    tests/parallel/tensor_nd. n: the tokens of the whole micro-batch (the grid splits them over its rows)."""
    if mode in ("2d", "2.5d"):
        row, col = (2, 1) if mode == "2.5d" else (1, 0)
        x = n // (side * depth) * (k // side) * elem  # this rank's panel of X: (n / (q d), k / q)
        w = (k // side) * (m // side) * elem  # of W: (k / q, m / q)
        fwd = [(row, Call("broadcast", x, side)), (col, Call("broadcast", w, side))]  # Xu et al., Algorithm 1
        bwd = [(col, Call("broadcast", w, side)), (row, Call("reduce", x, side)),  # dX = dY W^T
               (row, Call("broadcast", x, side)), (col, Call("reduce", w, side))]  # dW = X^T dY
        if mode == "2.5d":  # Tesseract: each depth layer's dW summed over the depth
            bwd.append((0, Call("all_reduce", w)))
        return fwd, bwd
    if mode == "3d":
        s, r = layout
        x, w, y = n // side * (k // side) * elem, (m // side) * (k // side) * elem, n // side * (m // side) * elem
        fwd = [(s, Call("all_gather", x)), (0, Call("all_gather", w)), (r, Call("reduce_scatter", y))]
        bwd = [(r, Call("all_gather", y)), (0, Call("reduce_scatter", w)), (s, Call("reduce_scatter", x))]
        return fwd, bwd
    raise ValueError(f"no call list for tp_mode {mode!r}")


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
            cells.append("-" if c is None else
                         f"{c['sent'] / mib:,.0f} / {c['weights'] / mib:,.1f} / {c['acts'] / mib:,.1f}")
        rows.append(f"| {mode} | {' | '.join(cells)} |")
    return "\n".join(rows)


def latency_steps(mode: str, devices: int) -> int | None:
    """Ring steps one linear layer's collectives take, fwd + bwd (each collective over n ranks: n - 1 steps,
    an all-reduce 2(n - 1)); None if the mode has no grid of that size."""
    grid = grid_side(mode, devices)
    if grid is None:
        return None
    side, depth = grid
    if mode == "1d":
        return 2 * (devices - 1)
    if mode == "2d":
        return 6 * side * (side - 1)
    if mode == "2.5d":
        return 6 * side * (side - 1) + 2 * (depth - 1)
    return 6 * (side - 1)


def layer_seconds(mode: str, devices: int, tokens: int, hidden: int, link_gbps: float, latency_us: float,
                  elem: int = 2) -> float | None:
    """One linear layer's communication, fwd + bwd, at a link of link_gbps GB/s and latency_us per ring step."""
    costs, steps = layer_costs(mode, devices, tokens, hidden, elem), latency_steps(mode, devices)
    if costs is None or steps is None:
        return None
    return costs["sent"] / (link_gbps * 1e9) + steps * latency_us * 1e-6


LINKS = {"NVLink 4 (450 GB/s, 2 us)": (450.0, 2.0), "InfiniBand NDR (50 GB/s, 5 us)": (50.0, 5.0),
         "Ethernet 100G (12.5 GB/s, 20 us)": (12.5, 20.0)}


def seconds_table(tokens: int = 8 * 2048, hidden: int = 12288, devices=(8, 64, 512)) -> str:
    """Markdown: each mode's per-layer communication time (ms) at each link and group size; the winner marked."""
    rows = [f"| link | mode | {' | '.join(f'{d} devices (ms)' for d in devices)} |",
            "|---|---|" + "---|" * len(devices)]
    for link, (gbps, lat) in LINKS.items():
        times = {m: [layer_seconds(m, d, tokens, hidden, gbps, lat) for d in devices] for m in MODES}
        best = [min(t[i] for t in times.values() if t[i] is not None) for i in range(len(devices))]
        for mode in MODES:
            cells = ["-" if t is None else f"{1e3 * t:,.2f}{' *' if t == best[i] else ''}"
                     for i, t in enumerate(times[mode])]
            rows.append(f"| {link} | {mode} | {' | '.join(cells)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(table())
    print()
    print(seconds_table())
