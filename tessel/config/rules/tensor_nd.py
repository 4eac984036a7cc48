"""Tensor parallelism over a grid (parallel.tp_mode 2d / 2.5d / 3d, tessel.parallel.tensor_nd): the model's
rules (tp_grid_refusal, which the planner's search enumerates grids through), then how the grid composes
with the other strategies. What is not built or tested yet is refused by name."""

from __future__ import annotations

from tessel.config.rule import Rule
from tessel.config.schema import ModelConfig
from tessel.hf.grid import hf_grid_refusal
from tessel.hf.shape import read_config


def _tp_grid_side(mode: str, tp: int, depth: int) -> int | None:
    """q of a q x q (2d) or q x q x depth (2.5d) grid, c of a c x c x c cube (3d); None if tp is no such grid."""
    root = {"2d": 2, "2.5d": 2, "3d": 3}[mode]
    cells = tp // depth if mode == "2.5d" else tp
    side = round(cells ** (1 / root))
    return side if side >= 2 and side ** root * (depth if mode == "2.5d" else 1) == tp else None


def tp_grid_refusal(m: ModelConfig, mode: str, tp: int, depth: int, micro_batch: int,
                    pp: int = 1) -> tuple[str, str] | None:
    """(field, message) of the first rule a model breaks on a tp grid (tessel.parallel.tensor_nd), None if it
    keeps them all: the tp group must be a q x q grid (2d), a q x q x depth grid (2.5d) or a c x c x c cube (3d);
    the hidden size splits in q*q (c*c*c) pieces (embedding and norms), heads, kv heads, feed-forward and
    vocabulary over the side, and each rank's micro-batch over the grid's batch chunks (q, q*depth, c*c).
    The planner's search (tessel.planner.search) enumerates grids through this same function."""
    if mode == "1d" or tp == 1:
        return None
    side = _tp_grid_side(mode, tp, depth)
    shape = {"2d": "q*q", "2.5d": f"q*q*tp_depth (q*q*{depth})", "3d": "c*c*c"}[mode]
    if side is None:
        return "parallel.tp", f"({tp}) must be {shape} with a side >= 2 for tp_mode '{mode}'"
    pieces = side ** 3 if mode == "3d" else side ** 2
    chunks = {"2d": side, "2.5d": side * depth, "3d": side * side}[mode]
    if m.d_model % pieces:
        return "model.d_model", (f"({m.d_model}) must be divisible by {pieces} "
                                 f"(tp_mode '{mode}' splits the embedding and norms in {pieces} pieces)")
    for name, value in (("n_head", m.n_head), ("n_kv_head", m.kv_heads), ("d_ff", m.ffn_dim),
                        ("vocab_size", m.vocab_size)):
        if value % side:
            return f"model.{name}", f"({value}) must be divisible by the grid's side {side}"
    if micro_batch % chunks:
        return "train.global_batch", (f"each rank's micro-batch ({micro_batch}) must be divisible by "
                                      f"the {chunks} batch chunks of tp_mode '{mode}'")
    if m.n_experts and m.hf_config is None:
        return "parallel.tp_mode", f"'{mode}' splits dense models only (no MoE) so far"
    if m.hf_config is not None:
        why = hf_grid_refusal(read_config(m.hf_config), mode, side)
        if why is not None:
            return "model.hf_config", f"tp_mode '{mode}': model_type {read_config(m.hf_config)['model_type']!r}: {why}"
    if m.hf_config is not None and pp > 1:
        return "parallel.pp", (f"a Hugging Face model under tp_mode '{mode}' and a pipeline is not tested yet; "
                               "set pp = 1")
    if m.tie_embeddings and pp > 1:
        return "model.tie_embeddings", (f"a head tied to the embedding under tp_mode '{mode}' and a pipeline is not "
                                        "built yet (the last stage's copy of the table); untie them or set pp = 1")
    return None



def _grid(c) -> bool:
    return c.parallel.tp_mode != "1d" and c.parallel.tp != 1


def _refusal(c) -> tuple[str, str] | None:
    p, t = c.parallel, c.train
    micro = t.global_batch // (p.batch_shards * t.grad_accum * p.micro_batches)
    return tp_grid_refusal(c.model, p.tp_mode, p.tp, p.tp_depth, micro, p.pp)


RULES = [
    Rule("parallel.tp_depth", lambda c: c.parallel.tp_depth == 1 or c.parallel.tp_mode == "2.5d",
         "is the depth of a 2.5d grid only"),
    Rule("parallel.tp_depth", lambda c: c.parallel.tp_mode != "2.5d" or c.parallel.tp == 1 or c.parallel.tp_depth >= 2,
         "a 2.5d grid needs a depth >= 2 (depth 1 is tp_mode '2d')"),
    Rule(lambda c: _refusal(c)[0], lambda c: _refusal(c) is None, lambda c: _refusal(c)[1], when=_grid),
    Rule("parallel.ep", lambda c: c.parallel.ep == 1,
         lambda c: f"experts split over ep under tp_mode '{c.parallel.tp_mode}' are not built yet: "
         "the grid computes an MoE block whole on every rank (set ep = 1, or tp_mode = '1d')", when=_grid),
    Rule("parallel.sequence_parallel", lambda c: not c.parallel.sequence_parallel,
         lambda c: f"means nothing under tp_mode '{c.parallel.tp_mode}': each rank already holds a batch chunk and "
         "a hidden chunk of every activation, norms included, so nothing is replicated for it to split; set it to "
         "false", when=_grid),
    Rule("parallel.tp_mode",
         lambda c: c.parallel.dp_arch == "allreduce" and (c.parallel.zero_stage <= 2 or c.parallel.pp == 1),
         lambda c: f"'{c.parallel.tp_mode}' composes with dp, ZeRO-1/2/3 and pp so far (ZeRO-3 with a pipeline and "
         "the parameter server are not tested yet)", when=_grid),
]
