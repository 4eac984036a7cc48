"""What every pricer reads: the model's sizes, the dtypes, a collective's price on a group, a block's compute.

tessel.planner.cost.CostModel is a Pricing that composes the pricers; each pricer holds the Pricing it
prices for.

Communication is priced call by call: tessel.planner.traffic lists the collectives tessel's layers,
data-parallel wrappers and pipeline issue, and each call costs the probe's measured fit for its op and
group size on "this" machine, or the network model (tessel.planner.network: NVLink rings, rails, SHARP,
PXN) on a preset cluster. Placement: ranks are ordered pp > dp > ep > cp > tp (tp innermost), as
tessel.mesh lays them out; a group's geometry (members per node, nodes) says which links it uses
(tessel.planner.cluster.group_geometry).

Compute: on "this" machine, the profile's measured speed of the whole model (tessel.calibrate.profile);
on a GPU preset, a roofline per op of every block (tessel.planner.compute); on a cluster without either,
a flat fraction of the peak.
"""

from __future__ import annotations

import math
from dataclasses import replace

from tessel.axes import AXES
from tessel.config import compute_bytes, compute_dtype
from tessel.planner import grid_cost
from tessel.planner.calibration import Calibration
from tessel.planner.cluster import Cluster, Geometry, group_geometry
from tessel.planner.compute import Shape, block_seconds, edge_seconds
from tessel.planner.layout import Layout
from tessel.planner.model_spec import ModelSpec
from tessel.planner.network import NONE, Cost, collective
from tessel.planner.pricing import Chunk
from tessel.planner.traffic import Call, dropless_rows

ORDER = AXES  # tessel.mesh lays ranks out in this order by default
# dp: the gradients' group, every axis that sees different tokens (tessel.axes.TOKEN_AXES)
GROUP_AXES = {"tp": ("tp",), "pp": ("pp",), "ep": ("ep",), "dp": ("dp", "ep", "cp"), "dp_expert": ("dp", "cp"),
              "cp": ("cp",)}


class Pricing:
    """One model on one cluster at one precision: the facts and prices every strategy's pricer reads."""

    def __init__(self, spec: ModelSpec, cluster: Cluster, precision: str = "bf16",
                 calibration: Calibration | None = None, bucket_mb: float = 25.0, reduce_dtype: str | None = None,
                 compiled: bool = False, fused_loss: bool = False):
        self.spec, self.cluster, self.precision = spec, cluster, precision
        # train.compile != "off" and train.fused_loss: priced by the roofline (tessel.planner.compute) and,
        # for the loss, in memory; a measured profile ("this") times the model as it was profiled
        self.compiled, self.fused_loss = compiled, fused_loss
        self.cal = calibration or Calibration()
        self.bucket_bytes = bucket_mb * 2**20
        self.reduce_dtype = reduce_dtype  # parallel.zero_reduce_dtype; None: the layout's param_dtype
        n_layer = spec.cfg.n_layer
        # tessel's experts compute only the rows they keep (tessel.models.moe.Experts), not a
        # buffer padded to the capacity; the profile converts its times with the same count
        self.layer_flops = [spec.layer_fwd_flops_per_token(i) for i in range(n_layer)]
        self.layer_params = [spec.layer_params(i) for i in range(n_layer)]
        self.act_bytes = compute_bytes(precision)
        self.moe_flags = [spec.is_moe(i) for i in range(n_layer)]
        self.model_flops_tok = spec.model_flops_per_token()
        # the per-op device model prices compute where nothing was measured and the cluster has one
        self.roofline = cluster.sms > 0 and not (self.cal.flops_points or self.cal.tp_points)
        self._block_memo: dict = {}
        self._shape_memo: dict = {}
        self._groups_memo: dict = {}

    # -- dtypes --------------------------------------------------------------------------
    def param_bytes(self, layout: Layout) -> int:
        """Bytes of a stored parameter: bf16 where ZeRO stores them so (the runtime allows it with ZeRO
        and without a pipeline, tessel.config), fp32 otherwise."""
        return 2 if layout.zero_param_dtype == "bf16" and layout.zero_stage >= 1 and layout.pp == 1 else 4

    def reduce_bytes(self, layout: Layout) -> int:
        """Bytes of a reduced gradient element: parallel.zero_reduce_dtype, else the stored parameters'."""
        if self.param_bytes(layout) == 4 and self.reduce_dtype in (None, "fp32"):
            return 4
        bf16 = (self.reduce_dtype or layout.zero_param_dtype) == "bf16"
        return 2 if bf16 and layout.zero_stage >= 1 and layout.pp == 1 else 4

    def dtype(self) -> str:
        return compute_dtype(self.precision)

    # -- communication -------------------------------------------------------------------
    def groups(self, layout: Layout) -> dict[str, Geometry]:
        """How each of the layout's groups lies on the nodes (tp innermost)."""
        sizes = layout.axis_sizes
        key = tuple(sizes.values())
        if key not in self._groups_memo:  # every pricer asks; a search holds few distinct degrees
            self._groups_memo[key] = {name: group_geometry(sizes, ORDER, axes, self.cluster.devices_per_node)
                                      for name, axes in GROUP_AXES.items()}
        return self._groups_memo[key]

    def fit(self, op: str, n: int) -> list[float] | None:
        """The probe's alpha-beta fit for (op, n) on this machine. A p2p message is priced as it was
        measured while the other ranks computed (tessel.calibrate.profile._p2p_under_load), which is how a
        pipeline's and a ring's messages travel; a probe without that measurement gives the idle fit."""
        fits = self.cluster.collectives
        if op == "p2p":
            return fits.get("p2p_loaded/2") or fits.get("p2p/2")
        return fits.get(f"{op}/{n}")

    def cost(self, op: str, nbytes: float, geo: Geometry) -> Cost:
        """One collective over a group shaped `geo`, with the links it holds: the probe's fit on this
        machine's one node, the network model (tessel.planner.network) on a preset."""
        if geo.n <= 1:
            return NONE
        fit = self.fit(op, geo.n)
        if fit and geo.nodes == 1:
            return Cost(fit[0] + fit[1] * nbytes, fit[1] * nbytes, 0.0)
        return collective(op, nbytes, geo, self.cluster)

    def price_group(self, calls: list[Call], geo: Geometry) -> Cost:
        total = NONE
        for c in calls:
            total = total + self.cost(c.op, c.nbytes, geo).times(c.count)
        return total

    # -- compute -------------------------------------------------------------------------
    def flops_per_s(self, tokens: int, tp: int = 1) -> float:
        """Whole-model FLOP/s one rank achieves on micro-batches of `tokens` under `tp`."""
        return self.cal.achieved(tokens, self.cluster.flops(self.precision) * tp, tp)

    def attention_core_flops(self, tokens: int) -> float:
        """Forward FLOPs of one block's attention core for `tokens` (scores and weighted sum, the whole
        square as tessel counts them): what selective recompute runs again."""
        return 4 * self.spec.seq_len * self.spec.attention.heads * self.spec.head_dim * tokens

    def chunk_compute(self, layout: Layout, chunk: Chunk) -> tuple[float, float, float, float]:
        """(forward, backward, the blocks' forward, their attention cores' forward) seconds of one chunk for
        one micro-batch on one tp rank: the last two are what recomputation runs again."""
        if self.roofline:
            return self._chunk_roofline(layout, chunk)
        tokens = chunk.tokens
        fwd_flops = sum(self.layer_flops[i] for i in chunk.layers) * tokens
        head = self.spec.head_fwd_flops_per_token * tokens if chunk.last else 0.0
        # measured on the tp-sharded shapes where profiled (small matrices run less efficiently)
        speed = self.flops_per_s(tokens, layout.tp)
        f, h = fwd_flops / speed, head / speed
        return f + h, 2 * (f + h), f, len(chunk.layers) * self.attention_core_flops(tokens) / speed

    def _chunk_roofline(self, layout: Layout, chunk: Chunk) -> tuple[float, float, float, float]:
        if layout.tp_mode != "1d" and layout.tp > 1:
            return self._grid_chunk_roofline(layout, chunk)
        f = b = core = 0.0
        for i in chunk.layers:
            bf, bb, bc = self.block(self.shape(layout, chunk.tokens, self.moe_flags[i]))
            f, b, core = f + bf, b + bb, core + bc
        blocks = f
        if chunk.first or chunk.last:
            vocab = math.ceil(self.spec.cfg.vocab_size / layout.tp)
            ef, eb = edge_seconds(self.shape(layout, chunk.tokens, False), vocab, self.cluster, self.dtype(),
                                  chunk.first, chunk.last)
            f, b = f + ef, b + eb
        return f, b, blocks, core

    def _grid_chunk_roofline(self, layout: Layout, chunk: Chunk) -> tuple[float, float, float, float]:
        """_chunk_roofline on a 2D / 2.5D / 3D grid (tessel.planner.grid_cost: the rank's shapes, its GEMMs
        in the grid's steps)."""
        grid = grid_cost.layout_grid(layout)
        first, last = chunk.first, chunk.last
        key = (grid, chunk.tokens, self.param_bytes(layout), first, last)
        if key not in self._block_memo:  # (block, edges) seconds: thousands of layouts share a few
            whole = replace(layout, tp=1, tp_mode="1d")  # (at tp 1 sequence parallelism splits nothing)
            shape = grid_cost.rank_shape(grid, self.shape(whole, chunk.tokens, False))
            edges = grid_cost.edge_seconds(shape, grid, self.spec.cfg.vocab_size, self.cluster, self.dtype(),
                                           first, last) if first or last else (0.0, 0.0)
            self._block_memo[key] = grid_cost.block_seconds(shape, grid, self.cluster, self.dtype()), edges
        (bf, bb, bc), (ef, eb) = self._block_memo[key]
        n = len(chunk.layers)
        return n * bf + ef, n * bb + eb, n * bf, n * bc

    def block(self, shape: Shape) -> tuple[float, float, float]:
        """(forward, backward, attention core forward) seconds of one block of `shape` (tessel.planner.compute)."""
        if shape not in self._block_memo:  # thousands of layouts share a few block shapes
            self._block_memo[shape] = block_seconds(shape, self.cluster, self.dtype())
        return self._block_memo[shape]

    def shape(self, layout: Layout, tokens: int, moe: bool) -> Shape:
        """The block one tp rank of a 1d layout computes for `tokens` tokens (tessel.planner.compute)."""
        # every block of a chunk asks, for each of the search's layouts: memoised on what the shape reads
        key = (layout.tp, layout.ep, layout.cp, layout.sequence_parallel, self.param_bytes(layout), tokens, moe)
        if key not in self._shape_memo:
            self._shape_memo[key] = self._shape(layout, tokens, moe)
        return self._shape_memo[key]

    def _shape(self, layout: Layout, tokens: int, moe: bool) -> Shape:
        spec, c = self.spec, self.spec.cfg
        bf16_storage = self.param_bytes(layout) == 2
        act = self.act_bytes
        local_experts = spec.n_experts // layout.ep if moe else 0
        latent = spec.attention.gemms(layout.tp) if spec.attention.latent else ()  # its own projections
        return Shape(tokens=tokens, seq=spec.seq_len, d_model=c.d_model, heads=c.n_head // layout.tp,
                     kv_heads=max(1, c.kv_heads // layout.tp), head_dim=spec.head_dim,
                     ffn=spec.expert_ffn if moe else c.ffn_dim // layout.tp, mlp_matrices=spec.mlp_matrices,
                     sp_tokens=tokens // layout.tp if layout.sequence_parallel else tokens, act=act,
                     resid=2 if act == 2 and bf16_storage else 4,  # fp32 weights keep the residual fp32
                     cast=act == 2 and not bf16_storage, fused=self.cluster.fused_attention,
                     experts=local_experts, cp=layout.cp,
                     expert_rows=expert_rows(spec, tokens, layout.ep) if moe else 0,
                     router=spec.n_experts if moe else 0, compiled=self.compiled, fused_loss=self.fused_loss,
                     shared_ffn=spec.shared_ffn if moe else 0, attn_gemms=latent, fp8=self.precision == "fp8")

    # -- what a rank holds -----------------------------------------------------------------
    def stage_params(self, layout: Layout, chunks, all_chunks) -> tuple[float, float]:
        """(dense, expert) parameters held by one device before ZeRO."""
        dense = expert = whole = 0.0
        for k in chunks:
            for i in all_chunks[k]:
                d, e = self.layer_params[i]
                dense += d
                expert += e
                whole += self.spec.layer_tp_whole_params(i)
        if 0 in chunks:
            dense += self.spec.embedding_params
        if len(all_chunks) - 1 in chunks:
            dense += self.spec.head_params
            if self.spec.cfg.tie_embeddings and 0 not in chunks:  # the last stage's copy of the tied embedding
                dense += self.spec.cfg.vocab_size * self.spec.cfg.d_model
        shards = grid_cost.weight_shards(layout)  # tp, or a grid's pieces (2.5D's depth layers hold copies)
        # routed experts are split over ep only: an MoE block runs whole on every tp rank (layer_tp_whole_params)
        return (dense - whole) / shards + whole, expert / layout.ep

    def largest_block_bytes(self, tp: int) -> float:  # tp: the pieces a weight is split into
        """fp32 bytes of the biggest block's parameters on one tp rank: what ZeRO-3 gathers at once."""
        return 4 * max(sum(p) for p in self.layer_params) / tp


def expert_rows(spec: ModelSpec, tokens: int, ep: int) -> int:
    """Token rows each of a rank's experts computes for `tokens` tokens a rank: the mean, within the capacity;
    dropless (model.capacity_factor = 0), the busiest rank's rows (its grouped GEMM) spread over its experts
    (tessel.planner.traffic.dropless_rows)."""
    mean = tokens * ep * spec.moe_top_k / spec.n_experts  # each of ep ranks routes `tokens` to k experts
    if spec.cfg.capacity_factor == 0:
        local = spec.n_experts // ep
        mean = dropless_rows(mean * local, ep) / local
    return max(1, round(mean))
