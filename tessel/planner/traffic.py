"""Which collectives tessel's trainer issues, call by call, and what each one costs.

The alpha-beta formulas of tessel.planner.cost price a collective from a link's
bandwidth and latency. On a GPU cluster that is a fair model; on gloo over CPU
ranks that share cores, each call also pays a large fixed cost (wake-ups,
scheduling, Python), and the all-gather, reduce-scatter and all-to-all paths
have their own speeds. So the probe (tessel.calibrate.profile) times every op at
several sizes on the concurrent groups a layout uses and fits, per op and group
size, time = alpha + beta * bytes; a call list is then priced call by call.

The call lists below are read off the code, not guessed:
- tessel.parallel.tensor.tensor_parallel / comm (Megatron f/g, Shoeybi et al. 2019;
  sequence-parallel g/g-bar, Korthikanti et al. 2022): per block, each of the
  attention and MLP regions is entered once (f: all-reduce in backward; SP:
  all-gather forward, reduce-scatter backward) and left once (g: all-reduce
  forward; SP: reduce-scatter forward, all-gather backward). Under SP each norm
  weight's gradient is all-reduced (CopyToTP on the weight). The vocab-parallel
  embedding leaves a region, the head enters one, and the vocab-parallel
  cross-entropy all-reduces the row max and (target logit, sum of exp).
- tessel.parallel.expert.expert_parallel: dispatch exchanges per-expert counts, then the
  tokens; combine sends them back; backward mirrors both token exchanges.
- tessel.parallel.data.data_parallel and zero: gradient buckets (first 1 MiB, then
  bucket_mb); ZeRO-1 all-reduces them, ZeRO-2 reduce-scatters them, and both
  all-gather the updated shards after the step; ZeRO-3 gathers each block
  (unit) before its forward and its backward and reduce-scatters its gradient.

- tessel.parallel.pipeline: each micro-batch's activation crosses every stage
  boundary forward and its gradient backward, one message each; the loss
  reaches the other stages as one message from the last (gloo; NCCL
  broadcasts it), and the bubble metrics are two all-reduces over pp.
- tessel.train.trainer and tessel.parallel.norms, once per step: the gradient
  norm's partial sums (4 bytes over each sharding axis: tp, pp, and dp x ep
  where ZeRO shards the optimizer's parameters); the loss mean over dp x ep,
  the all-finite/stop vote and the norm's key agreement over the world (see
  trainer_calls: priced by the calibration's measured overhead instead).

Sizes follow one convention per op: all_reduce the buffer, all_gather the
gathered output, reduce_scatter the (whole) input, all_to_all one rank's send
buffer, p2p one message. tests/planner/test_traffic_matches_runtime.py records
the calls of real steps and compares them with CostModel.step_calls, built from
these lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "p2p")


@dataclass(frozen=True)
class Call:
    op: str
    nbytes: float
    count: float = 1.0


def fit_alpha_beta(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha s, beta s/byte) minimising the squared *relative* error of alpha + beta*x over (x, t) points.

    Relative, because sizes span three orders of magnitude: an absolute fit
    would ignore the small calls, whose time is all alpha. Both are clamped at 0.
    Weighted least squares with weights 1/t^2 has the closed form below.
    """
    w = [1.0 / (t * t) for _, t in points]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, points))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, points))
    st = sum(wi * t for wi, (_, t) in zip(w, points))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, points))
    det = sw * sxx - sx * sx
    if det <= 0:  # one size only: all of it is latency
        return st / sw, 0.0
    beta = (sw * sxt - sx * st) / det
    alpha = (st - beta * sx) / sw
    if beta < 0:
        return st / sw, 0.0
    if alpha < 0:  # through the origin
        return 0.0, sxt / sxx
    return alpha, beta


def tp_block_calls(d_model: int, tokens: int, act_bytes: int, sp: bool) -> tuple[list[Call], list[Call]]:
    """(forward, backward) tp collectives of one dense transformer block for one micro-batch."""
    act = tokens * d_model * act_bytes  # the whole (B, T, C) activation
    if not sp:
        return [Call("all_reduce", act, 2)], [Call("all_reduce", act, 2)]
    fwd = [Call("all_gather", act, 2), Call("reduce_scatter", act, 2)]
    # the two norm weights' gradients (fp32 parameters) are summed over tp
    bwd = [Call("reduce_scatter", act, 2), Call("all_gather", act, 2), Call("all_reduce", 4 * d_model, 2)]
    return fwd, bwd


def tp_moe_block_calls(d_model: int, tokens: int, act_bytes: int) -> tuple[list[Call], list[Call]]:
    """An MoE block under tp (no SP): attention as a dense block, the MoE feed-forward replicated."""
    act = tokens * d_model * act_bytes
    return [Call("all_reduce", act)], [Call("all_reduce", act)]


def tp_edge_calls(d_model: int, vocab: int, tokens: int, act_bytes: int, sp: bool,
                  first: bool, last: bool) -> tuple[list[Call], list[Call]]:
    """(forward, backward) tp collectives of the embedding (first stage) and head + loss (last stage)."""
    act = tokens * d_model * act_bytes
    fwd: list[Call] = []
    bwd: list[Call] = []
    if first:  # the vocab-parallel embedding leaves a region
        fwd.append(Call("reduce_scatter" if sp else "all_reduce", act))
        if sp:
            bwd.append(Call("all_gather", act))
    if last:  # the head enters one, the loss needs the row max and the (target, sum exp) pair
        if sp:
            fwd.append(Call("all_gather", act))
            bwd += [Call("reduce_scatter", act), Call("all_reduce", 4 * d_model)]  # + final norm weight
        else:
            bwd.append(Call("all_reduce", act))
        fwd += [Call("all_reduce", 4 * tokens), Call("all_reduce", 8 * tokens)]
    return fwd, bwd


def tp_chunk_calls(d_model: int, vocab: int, tokens: int, act_bytes: int, n_dense: int, n_moe: int, sp: bool,
                   recompute: bool, first: bool, last: bool) -> tuple[list[Call], list[Call]]:
    """(forward, backward) tp collectives of a chunk of n_dense + n_moe blocks (+ its edges) for one
    micro-batch; recomputation repeats each block's forward collectives in backward."""
    fwd, bwd = [], []  # every block of a kind issues the same calls: one list, counts times n
    for n, (f, b) in ((n_dense, tp_block_calls(d_model, tokens, act_bytes, sp)),
                      (n_moe, tp_moe_block_calls(d_model, tokens, act_bytes))):
        if n:
            fwd += times(f, n)
            bwd += times(b + (f if recompute else []), n)
    f, b = tp_edge_calls(d_model, vocab, tokens, act_bytes, sp, first, last)
    return fwd + f, bwd + b


def ep_block_calls(d_model: int, tokens: int, act_bytes: int, top_k: int, capacity: float,
                   n_experts: int) -> tuple[list[Call], list[Call]]:
    """(forward, backward) all-to-alls of one MoE block over ep."""
    routed = tokens * top_k * capacity * d_model * act_bytes
    fwd = [Call("all_to_all", 8 * n_experts), Call("all_to_all", routed, 2)]  # counts, tokens out and back
    return fwd, [Call("all_to_all", routed, 2)]


def dropless_rows(mean_rows: float, ep: int) -> float:
    """The busiest of ep ranks' rows when each holds mean_rows on average, routed without a cap: a balanced
    router (bias or aux loss) leaves the counts at best as if each assignment picked a rank at random, whose
    largest of ep near-Poisson counts is ~ mean + sqrt(2 mean ln ep) (the Gaussian maximum); one rank (ep = 1)
    holds every row."""
    return mean_rows + math.sqrt(2 * mean_rows * math.log(ep)) if ep > 1 else mean_rows


def sent_rows_factor(capacity_factor: float, assignments: float, ep: int) -> float:
    """Rows a rank sends (and receives) per assignment: the capacity's bound, or dropless, the busiest rank's
    share of the assignments over the mean."""
    if capacity_factor > 0:
        return capacity_factor
    return dropless_rows(assignments, ep) / assignments if assignments else 1.0


def ep_chunk_calls(d_model: int, tokens: int, act_bytes: int, top_k: int, capacity: float, n_experts: int,
                   n_moe: int, recompute: bool) -> tuple[list[Call], list[Call]]:
    """(forward, backward) all-to-alls of a chunk's n_moe MoE blocks for one micro-batch."""
    f, b = ep_block_calls(d_model, tokens, act_bytes, top_k, capacity, n_experts)
    return times(f, n_moe), times(b + (f if recompute else []), n_moe)


def pp_calls(message_bytes: float, chunks: list[int], n_chunks: int, micro_batches: int) -> list[Call]:
    """p2p messages of one pipeline rank holding model chunks `chunks` (of 0..n_chunks-1) in one step.

    Every micro-batch's activation crosses each chunk boundary forward and its
    gradient backward: a chunk receives and sends each unless it is the first
    (nothing to receive forward, nothing to send back) or the last.
    """
    boundaries = sum((k > 0) + (k < n_chunks - 1) for k in chunks)
    return [Call("p2p", message_bytes, 2 * boundaries * micro_batches)] if boundaries else []


def bookkeeping_calls(tp: int, pp: int, dp_shards: int, zero: int, stage: int, tied_bytes: float = 0.0,
                      ) -> dict[str, list[Call]]:
    """Per-step calls of the trainer's bookkeeping that the planner prices, by group.

    The gradient norm sums its squares over each axis that shards the gradients
    it sees (tessel.parallel.norms): tp, pp, and dp x ep under ZeRO (the
    optimizer holds shards). A pipeline adds its loss, one 4-byte message from
    the last stage to each other (the last sends pp - 1 of them), its two bubble
    metrics (8 and 24 bytes, fp64), and with tied embeddings the first and last
    stages' all-reduce of the embedding's gradient ("tied": a group of those two).
    Under several sharding axes at once the runtime sums once per set of axes a
    parameter is sharded over, on their joint group; it is listed here once per
    axis (4 bytes each: latency either way).
    """
    out: dict[str, list[Call]] = {}
    if tp > 1:
        out["tp"] = [Call("all_reduce", 4)]
    if dp_shards > 1 and zero >= 1:
        out["dp"] = [Call("all_reduce", 4)]
    if pp > 1:
        out["pp"] = [Call("all_reduce", 4), Call("p2p", 4, pp - 1 if stage == pp - 1 else 1),
                     Call("all_reduce", 8), Call("all_reduce", 24)]
        if tied_bytes and stage in (0, pp - 1):
            out["tied"] = [Call("all_reduce", tied_bytes)]
    return out


def trainer_calls(world: int, dp_shards: int) -> dict[str, list[Call]]:
    """The trainer's scalar collectives that the planner does not price call by call, by group.

    The loss mean over dp x ep (4 bytes) and the all-finite/stop vote over the
    world (tessel.train.fault.numerics.agreed_values, 8 bytes); the gradient
    norm agrees on its reductions once, in the first step (all_gather_object,
    tessel.parallel.norms), not in the steps priced here. They cost the same on
    every layout, latency only: the calibration measures them in a real step
    (Calibration.step_overhead_s), and presets ignore them.
    """
    out: dict[str, list[Call]] = {}
    if dp_shards > 1:
        out["dp"] = [Call("all_reduce", 4)]
    if world > 1:
        out["world"] = [Call("all_reduce", 8)]
    return out


def bucket_sizes(grad_bytes: float, bucket_bytes: float, first_bytes: float = 2**20) -> list[tuple[float, int]]:
    """(size, how many) of the gradient buckets tessel.parallel.data.data_parallel.build_buckets cuts: a bucket
    closes once it holds its limit (first 1 MiB, then bucket_bytes); what is left forms the last.

    Parameters are whole, so real buckets overshoot their limit by up to one
    parameter; at the granularity of a cost model that does not matter.
    """
    if grad_bytes <= 0:
        return []
    first = min(first_bytes, bucket_bytes)
    if grad_bytes <= first:
        return [(grad_bytes, 1)]
    rest = grad_bytes - first
    full = math.floor(rest / bucket_bytes)
    tail = rest - full * bucket_bytes
    return [(first, 1)] + ([(bucket_bytes, full)] if full else []) + ([(tail, 1)] if tail > 0 else [])


def times(calls: list[Call], n: float) -> list[Call]:
    """The calls, each issued n times as often (n blocks, n micro-batches)."""
    return [Call(c.op, c.nbytes, c.count * n) for c in calls]


def merged(calls: list[Call]) -> list[Call]:
    """Equal calls folded into one with their summed count (prices thousands of layers at once)."""
    out: dict[tuple[str, float], float] = {}
    for c in calls:
        out[c.op, c.nbytes] = out.get((c.op, c.nbytes), 0.0) + c.count
    return [Call(op, nbytes, count) for (op, nbytes), count in out.items()]


def dp_step_calls(grad_bytes: float, zero: int, bucket_bytes: float, unit_bytes: list[float] = (),
                  root_bytes: float = 0.0, whole_step: bool = False) -> tuple[list[Call], list[Call]]:
    """(per micro-batch, per step) data-parallel collectives for `grad_bytes` of whole fp32 gradients.

    Stage 0/1: one all-reduce per bucket after the last micro-batch (the others
    run under no_sync). Stage 2: a reduce-scatter per bucket for every
    micro-batch (tessel's LocalRunner runs all micro-batches but the last under
    no_sync, so today it reduce-scatters once per step and holds whole gradients
    meanwhile: tests/planner/test_traffic_matches_runtime.py marks that
    discrepancy). Stages 1 and 2 all-gather the updated shards once per step.
    Stage 3: per micro-batch, every unit (`unit_bytes`: one per block) is
    gathered for forward and again for backward, the root (embedding, head,
    final norm: `root_bytes`) once, as it stays gathered from the start of
    forward to the end of backward; every one's gradient is reduce-scattered.
    Stages 2 and 3 under a pipeline (`whole_step`): gradients accumulate over
    the micro-batches and are reduce-scattered once, on the rank's last
    backward; stage 2 gathers the updated shards after the step, stage 3 the
    whole stage when the step starts (tessel/parallel/zero/pipeline.py).
    """
    buckets = bucket_sizes(grad_bytes, bucket_bytes)
    if zero <= 1:
        step = [Call("all_reduce", b, k) for b, k in buckets]
        if zero == 1:
            step += [Call("all_gather", b, k) for b, k in buckets]
        return [], step
    if whole_step and zero >= 2:
        return [], [Call("all_gather", grad_bytes), Call("reduce_scatter", grad_bytes)]
    if zero == 2:
        return [Call("reduce_scatter", b, k) for b, k in buckets], [Call("all_gather", b, k) for b, k in buckets]
    per_mb = [Call("all_gather", u, 2) for u in unit_bytes] + [Call("all_gather", root_bytes)]
    per_mb += [Call("reduce_scatter", u) for u in [*unit_bytes, root_bytes]]
    return merged(per_mb), []


def sent_bytes(calls: list[Call], n: int) -> float:
    """Bytes one rank sends for `calls` in a group of n (ring algorithms; all-reduce sends twice)."""
    if n <= 1:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "p2p": 1.0}
    return sum(c.count * c.nbytes * factor.get(c.op, (n - 1) / n) for c in calls)
