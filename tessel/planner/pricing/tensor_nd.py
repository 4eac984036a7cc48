"""2D, 2.5D and 3D tensor parallelism in the estimate (tessel.parallel.tensor_nd).

The formulas are tessel.planner.grid_cost's (the grid, its groups on the nodes, each block's calls along
each grid dimension, what a block keeps); this pricer prices a chunk's calls on the groups of their grid
dimensions and hands the recompute pricer the grid's per-block activation bytes.
"""

from __future__ import annotations

from tessel.planner import grid_cost
from tessel.planner.cluster import Geometry
from tessel.planner.layout import Layout
from tessel.planner.network import NONE, Cost
from tessel.planner.pricing import Chunk, ChunkComm, Stage, StepTerms
from tessel.planner.pricing.base import ORDER, Pricing
from tessel.planner.traffic import merged, sent_bytes


class GridPricer:
    def __init__(self, pricing: Pricing):
        self.pricing = pricing
        self._memo: dict = {}

    def chunk_comm(self, layout: Layout, chunk: Chunk) -> ChunkComm | None:
        grid = grid_cost.layout_grid(layout)
        if grid is None:
            return None
        # what calls() and groups() read: the chunk's shape, the weights' dtype (the calls' bytes) and the degrees
        key = (grid, len(chunk.layers), chunk.first, chunk.last, layout.recompute == "full", chunk.tokens,
               self.pricing.param_bytes(layout), layout.dp, layout.pp, layout.ep)
        if key not in self._memo:  # thousands of layouts share a few chunk shapes
            self._memo[key] = self._priced(grid, layout, chunk)
        return self._memo[key]

    def _priced(self, grid, layout: Layout, chunk: Chunk) -> ChunkComm:
        """Each call priced on the groups of its grid dim."""
        fwd, bwd = self.calls(grid, len(chunk.layers), chunk.first, chunk.last, layout, chunk.tokens)
        geo = self.groups(layout)

        def priced(calls) -> Cost:
            return sum((self.pricing.price_group(merged([c for d, c in calls if d == a]), geo[a]) for a in geo), NONE)
        tf, tb = priced(fwd), priced(bwd)
        sent = sum(sent_bytes([c], grid.dims[a]) for a, c in fwd + bwd)
        return ChunkComm(tf.seconds, tb.seconds, {"tp": sent, "ep": 0.0}, (tf, tb))

    def calls(self, grid, n_blocks: int, first: bool, last: bool, layout: Layout, tokens: int):
        """(forward, backward) (grid dim, call) lists of one chunk for one micro-batch (tessel.planner.grid_cost)."""
        p = self.pricing
        resid = 2 if p.act_bytes == 2 and p.param_bytes(layout) == 2 else 4
        return grid_cost.chunk_calls(grid, p.spec, tokens, p.act_bytes, p.param_bytes(layout), resid, n_blocks,
                                     layout.recompute == "full", first, last)

    def groups(self, layout: Layout) -> dict[int, Geometry]:
        """{grid dim: how its groups lie on the nodes} of a 2D / 2.5D / 3D layout (tp innermost, the grid
        row-major inside the tp group)."""
        return grid_cost.grid_geometry(layout.axis_sizes, ORDER, grid_cost.layout_grid(layout),
                                       self.pricing.cluster.devices_per_node)

    def layer_bytes(self, layout: Layout, stage: Stage) -> list[float]:
        """What one block keeps on a rank of the grid: dense blocks only, every one the same (cp > 1 is
        refused with a grid)."""
        grid = grid_cost.layout_grid(layout)
        return [grid_cost.layer_activation_bytes(self.pricing.spec, stage.tokens, grid, self.pricing.precision)]

    def memory(self, layout: Layout, stage: Stage) -> dict[str, float]:
        return {}

    def step(self, layout: Layout, chunk_times, memory) -> StepTerms | None:
        return None
