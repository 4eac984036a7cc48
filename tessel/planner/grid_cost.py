"""2D, 2.5D and 3D tensor parallelism in the cost model (tessel.planner.cost): a layout's grid, where its
groups lie on the nodes, the collectives one block issues along each grid dimension, what one rank computes
and what a block keeps for backward.

The runtime is tessel.parallel.tensor_nd (SUMMA, Xu et al. 2021; Tesseract, Wang et al. 2021; the 3D cube,
Bian et al. 2021). The call lists below are read off its layers (summa.py, cube.py) and checked call by call
against a recorded training step (tests/parallel/tensor_nd/test_grid_modes.py); a linear layer's calls are
tessel.planner.tp_grid.linear_calls, whose bytes are tp_grid.linear_bytes.

Placement: tessel.mesh puts tp innermost and a tp group's grid is row-major over its members
(tessel.parallel.tensor_nd.grid: the last grid dimension varies fastest), so the grid's last dimension is a
run of neighbouring ranks and its first crosses nodes first once a tp group outgrows a node: a 2D grid of 64
on nodes of 8 has its rows on NVLink and its columns on the network.

Element sizes follow the 1D lists' convention (tessel.planner.traffic): activations and linear panels at the
compute dtype's size, the norms' and the embedding's weights at the stored parameters' (gathered as stored).
The recorded check runs fp32, where both are 4 bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from tessel.config import compute_bytes, compute_dtype
from tessel.planner.cluster import Cluster, Geometry, group_geometry
from tessel.planner.compute import (Gemm, Shape, backward, block_forward, block_weights, embedding_ops,
                                    grad_accumulation, head_ops, op_seconds)
from tessel.planner.model_spec import ModelSpec
from tessel.planner.tp_grid import MIXED, STREAM, Calls, linear_calls
from tessel.planner.traffic import Call

GRID_MODES = ("2d", "2.5d", "3d")


@dataclass(frozen=True)
class Grid:
    """A tp group of q x q (2D), depth x q x q (2.5D) or c x c x c (3D) ranks, as tessel.parallel.tensor_nd
    lays it out: dims outermost first; 2D and 2.5D's row group varies the last dim, the column group the
    one before it; 2.5D's depth group the first."""
    mode: str
    side: int
    depth: int = 1

    @property
    def dims(self) -> tuple[int, ...]:
        return {"2d": (self.side,) * 2, "2.5d": (self.depth, self.side, self.side), "3d": (self.side,) * 3}[self.mode]

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def batch_chunks(self) -> int:
        """Pieces a micro-batch's sequences are split into: rows (2D), depth x rows (2.5D), c*c (3D)."""
        return {"2d": self.side, "2.5d": self.side * self.depth, "3d": self.side ** 2}[self.mode]

    @property
    def weight_shards(self) -> int:
        """Pieces each weight is split into: every rank's (2D, 3D); 2.5D's depth layers hold copies."""
        return self.side ** 3 if self.mode == "3d" else self.side ** 2

    @property
    def row(self) -> int:
        return len(self.dims) - 1

    @property
    def col(self) -> int:
        return len(self.dims) - 2


def grid_of(mode: str, tp: int, depth: int = 1) -> Grid | None:
    """The grid of a tp group of `tp` ranks in `mode`, None in 1D (the layout is valid: tessel.config checked)."""
    if mode == "1d" or tp == 1:
        return None
    if mode == "3d":
        return Grid(mode, round(tp ** (1 / 3)))
    return Grid(mode, round((tp // depth) ** 0.5), depth if mode == "2.5d" else 1)


def layout_grid(lay) -> Grid | None:
    """A Layout's grid (tessel.planner.layout.Layout), None in 1D."""
    return grid_of(lay.tp_mode, lay.tp, lay.tp_depth)


def weight_shards(lay) -> int:
    """The pieces a layout's tp splits each dense weight into."""
    grid = layout_grid(lay)
    return lay.tp if grid is None else grid.weight_shards


def grid_sizes(world: int) -> list[tuple[str, int, int]]:
    """(mode, tp, depth) of every grid whose size divides `world`: 2D q x q, 2.5D q x q x d with 2 <= d <= q
    (Wang et al. 2021's range; d = 1 is 2D), 3D c x c x c; sides >= 2."""
    out = []
    for q in range(2, math.isqrt(world) + 1):
        if world % (q * q) == 0:
            out.append(("2d", q * q, 1))
            out += [("2.5d", q * q * d, d) for d in range(2, q + 1) if world % (q * q * d) == 0]
    c = 2
    while c ** 3 <= world:
        if world % c ** 3 == 0:
            out.append(("3d", c ** 3, 1))
        c += 1
    return out


def grid_geometry(sizes: dict[str, int], order: tuple[str, ...], grid: Grid,
                  devices_per_node: int) -> dict[int, Geometry]:
    """{grid dim: how its groups lie on the nodes}: the tp axis of `order` replaced by the grid's dims,
    outermost first (row-major inside the tp group)."""
    names = [f"tp.{a}" for a in range(len(grid.dims))]
    sub = {**{a: n for a, n in sizes.items() if a != "tp"}, **dict(zip(names, grid.dims, strict=True))}
    expanded = tuple(x for a in order for x in (names if a == "tp" else [a]))
    return {a: group_geometry(sub, expanded, (name,), devices_per_node) for a, name in enumerate(names)}


# ---- the collectives of one chunk, along each grid dimension -----------------------------------------

def norm_calls(g: Grid, tokens: int, d: int, param: int, resid: int) -> tuple[Calls, Calls]:
    """An RMSNorm on the grid: the sum of squares summed over the hidden chunks (forward and backward: both
    uses need every addend), its weight's pieces gathered (summa.RMSNorm2D, cube.RMSNorm3D)."""
    rows = tokens // g.batch_chunks * resid
    if g.mode == "3d":
        c = g.side
        return ([(1, Call("all_reduce", rows)), (2, Call("all_gather", d // c ** 2 * param)),
                 (0, Call("all_gather", d // c * param))],
                [(1, Call("all_reduce", rows)), (0, Call("reduce_scatter", d // c * param)),
                 (2, Call("reduce_scatter", d // c ** 2 * param))])
    q = g.side
    fwd = [(g.row, Call("all_reduce", rows)), (g.col, Call("all_gather", d // q * param))]
    bwd = [(g.row, Call("all_reduce", rows)), (g.col, Call("reduce_scatter", d // q * param))]
    if g.mode == "2.5d":
        bwd.append((0, Call("all_reduce", d // q ** 2 * param)))
    return fwd, bwd


def embedding_calls(g: Grid, vocab: int, d: int, param: int) -> tuple[Calls, Calls]:
    """The token table split over the hidden dim, this rank's hidden chunk gathered from its pieces."""
    if g.mode == "3d":
        c = g.side
        return ([(2, Call("all_gather", vocab * (d // c ** 2) * param)),
                 (0, Call("all_gather", vocab * (d // c) * param))],
                [(0, Call("reduce_scatter", vocab * (d // c) * param)),
                 (2, Call("reduce_scatter", vocab * (d // c ** 2) * param))])
    q = g.side
    fwd = [(g.col, Call("all_gather", vocab * (d // q) * param))]
    bwd = [(g.col, Call("reduce_scatter", vocab * (d // q) * param))]
    if g.mode == "2.5d":
        bwd.append((0, Call("all_reduce", vocab * (d // q ** 2) * param)))
    return fwd, bwd


def loss_calls(g: Grid, tokens: int) -> Calls:
    """The vocab-parallel cross-entropy along the vocabulary's chunks (row max; target logit and sum of exp),
    then the mean over the batch chunks (a scalar over each of their dims)."""
    rows = tokens // g.batch_chunks
    vocab_dim, batch_dims = (2, (1, 0)) if g.mode == "3d" else (g.row, (g.col, 0) if g.mode == "2.5d" else (g.col,))
    return [(vocab_dim, Call("all_reduce", 4 * rows)), (vocab_dim, Call("all_reduce", 8 * rows))] + \
        [(a, Call("all_reduce", 4)) for a in batch_dims]


def head_calls(g: Grid, spec: ModelSpec, tokens: int, act: int, param: int) -> tuple[Calls, Calls]:
    """The output head: a linear layer on L(2, 1); tied to the embedding (model.tie_embeddings), the table
    gathered again as the embedding gathers it, and multiplied without a weight gather (3D: TiedHead3D) or by
    SUMMA's C = A B^T, whose row panels are the logits' (2D, 2.5D: TiedHead2D)."""
    c = spec.cfg
    d, vocab = c.d_model, c.vocab_size
    if not c.tie_embeddings:
        return linear_calls(g.mode, tokens, d, vocab, g.side, g.depth, act, STREAM)
    fwd, bwd = embedding_calls(g, vocab, d, param)
    if g.mode == "3d":
        lf, lb = linear_calls(g.mode, tokens, d, vocab, g.side, g.depth, act, STREAM)
        return fwd + [x for x in lf if x[0] != 0], bwd + [x for x in lb if x[0] != 0]  # no weight gather (dim 0)
    q = g.side
    y = tokens // (q * g.depth) * (vocab // q) * act  # a panel of the logits: (n / (q d), V / q)
    w = (vocab // q) * (d // q) * act  # of the table's rows: (V / q, H / q)
    fwd += [(g.col, Call("broadcast", w, q)), (g.row, Call("reduce", y, q))]
    bwd += [(g.row, Call("broadcast", y, q)), (g.col, Call("broadcast", w, q)),  # dX = dY B
            (g.row, Call("broadcast", y, q)), (g.col, Call("reduce", w, q))]  # dB = dY^T X
    return fwd, bwd


def block_calls(g: Grid, spec: ModelSpec, tokens: int, act: int, param: int, resid: int) -> tuple[Calls, Calls]:
    """(forward, backward) of one dense block: two norms and its linear layers; attention (split by heads over
    the grid's columns) and the SwiGLU are local. 3D: the layers that read the stream take L(2, 1), the output
    projections L(1, 2) (tessel.parallel.tensor_nd.cube)."""
    c = spec.cfg
    d, qw, kvw, f = c.d_model, c.n_head * spec.head_dim, c.kv_heads * spec.head_dim, c.ffn_dim
    linears = [(d, qw, STREAM), (d, kvw, STREAM), (d, kvw, STREAM), (qw, d, MIXED)]
    linears += [(d, f, STREAM)] * (spec.mlp_matrices - 1) + [(f, d, MIXED)]
    fwd, bwd = [], []
    for _ in range(2):
        nf, nb = norm_calls(g, tokens, d, param, resid)
        fwd, bwd = fwd + nf, bwd + nb
    for k, m, layout in linears:
        lf, lb = linear_calls(g.mode, tokens, k, m, g.side, g.depth, act, layout)
        fwd, bwd = fwd + lf, bwd + lb
    return fwd, bwd


def chunk_calls(g: Grid, spec: ModelSpec, tokens: int, act: int, param: int, resid: int, n_blocks: int,
                recompute: bool, first: bool, last: bool) -> tuple[Calls, Calls]:
    """(forward, backward) of a chunk of n_blocks blocks and its edges for one micro-batch; full
    recomputation repeats each block's forward calls in backward."""
    f, b = block_calls(g, spec, tokens, act, param, resid)
    fwd = [(a, Call(x.op, x.nbytes, x.count * n_blocks)) for a, x in f]
    bwd = [(a, Call(x.op, x.nbytes, x.count * n_blocks)) for a, x in (b + (f if recompute else []))]
    c = spec.cfg
    if first:
        ef, eb = embedding_calls(g, c.vocab_size, c.d_model, param)
        fwd, bwd = fwd + ef, bwd + eb
    if last:
        nf, nb = norm_calls(g, tokens, c.d_model, param, resid)
        hf, hb = head_calls(g, spec, tokens, act, param)
        fwd, bwd = fwd + nf + hf + loss_calls(g, tokens), bwd + nb + hb
    return fwd, bwd


# ---- what one rank computes ----------------------------------------------------------------------------

def rank_shape(g: Grid, whole: Shape) -> Shape:
    """The block one rank of the grid computes, from the block's shape without tp (`whole`): its batch chunk
    of the tokens, its hidden chunk, the heads and feed-forward of its column. Its GEMMs are one step of the
    grid's (spread_gemms gives the rest)."""
    t = whole.tokens // g.batch_chunks
    return replace(whole, tokens=t, sp_tokens=t, d_model=whole.d_model // g.side, heads=whole.heads // g.side,
                   kv_heads=max(1, whole.kv_heads // g.side), ffn=whole.ffn // g.side)


def spread_gemms(ops: list, g: Grid) -> list:
    """A rank's GEMMs on rank_shape: SUMMA runs q of them, one per panel (Xu et al. Algorithm 1); 3D one on the
    rows it gathered, c times its batch chunk (Bian et al. section 3.1). Either way 1/tp of the FLOPs."""
    out: list = []
    for op in ops:
        if not isinstance(op, Gemm):
            out.append(op)
        elif g.mode == "3d":
            out.append(replace(op, m=op.m * g.side))
        else:
            out += [op] * g.side
    return out


def block_seconds(s: Shape, g: Grid, cl: Cluster, dtype: str) -> tuple[float, float, float]:
    """(forward, backward, attention core forward) of one block on one rank of the grid (s: rank_shape)."""
    fwd, core = block_forward(s)
    fwd = spread_gemms(fwd, g)
    f = sum(op_seconds(op, cl, dtype) for op in fwd)
    c = sum(op_seconds(op, cl, dtype) for op in core)
    b = sum(op_seconds(op, cl, dtype) for op in backward(fwd + core))
    b += op_seconds(grad_accumulation(block_weights(s), s), cl, dtype)
    return f + c, b, c


def edge_seconds(s: Shape, g: Grid, vocab: int, cl: Cluster, dtype: str, first: bool,
                 last: bool) -> tuple[float, float]:
    """(forward, backward) of the embedding (the whole vocabulary, this rank's hidden chunk) and of the final
    norm, head (vocab / side columns on the grid) and loss."""
    f = b = 0.0
    if first:
        fw, bw = embedding_ops(s, vocab)
        f, b = f + sum(op_seconds(op, cl, dtype) for op in fw), b + sum(op_seconds(op, cl, dtype) for op in bw)
    if last:
        fw, bw = head_ops(s, vocab // g.side)
        f += sum(op_seconds(op, cl, dtype) for op in spread_gemms(fw, g))
        b += sum(op_seconds(op, cl, dtype) for op in spread_gemms(bw, g))
    return f, b


# ---- what a block keeps for backward ------------------------------------------------------------------

def layer_activation_bytes(spec: ModelSpec, tokens: int, g: Grid, precision: str) -> float:
    """Bytes one dense block keeps for backward on one rank of the grid, for a micro-batch of `tokens`: the
    terms of tessel.planner.memory.layer_activation_bytes (the residual stream, the linear layers' inputs, the
    attention's and SwiGLU's tensors), none of them replicated.

    2D and 2.5D: each is a block of the whole, 1/tp of it (SUMMA saves its own panels of X and W). 3D: each
    linear layer saves the input it gathered over one side of the cube (c times its block; q, k, v, gate and up
    each gather their own) and the weight it gathered (out/c x in/c): Bian et al.'s memory for speed. Either
    way each norm keeps the weight it gathered (a hidden chunk, fp32), and its rms once per row of its batch
    chunk (every hidden chunk of the row needs it). tests/parallel/tensor_nd measures it, to the byte.
    """
    c = spec.cfg
    a = compute_bytes(precision)
    qw = c.n_head * spec.head_dim
    stream = 4 * c.d_model * 4
    split = (5 * qw + 4 * c.ffn_dim) * a + c.n_head * 4
    norms = tokens * 2 * 4 / g.batch_chunks + 2 * c.d_model / g.side * 4  # the rms per row, the gathered weights
    if g.mode != "3d":
        casts = 5 * c.d_model * 2 if compute_dtype(precision) == "bf16" else 2 * c.d_model * 4
        return tokens * (stream + casts + split) / g.size + norms
    side = g.side
    inputs = 5 * c.d_model * a * side + (qw + c.ffn_dim) * a * (side - 1)  # gathered; wo's and down's replace theirs
    weights = (spec.attn_matrix_params + spec.mlp_matrix_params) / side ** 2 * a
    return tokens * (stream + inputs + split) / g.size + weights + norms
