"""The pricers' interface (tessel.planner.pricing): every strategy's pricer answers the same three questions,
and the estimate is their sum (no processes)."""

from tessel.planner.cluster import get_cluster
from tessel.planner.cost import CostModel
from tessel.planner.layout import Layout
from tessel.planner.model_spec import preset
from tessel.planner.pricing import MEMORY_TERMS, Chunk, ChunkComm
from tests.planner.cases import flat_cluster, tiny_spec


def test_every_strategy_has_one_pricer_with_the_three_terms():
    cm = CostModel(tiny_spec(), flat_cluster(), "fp32")
    names = {type(p).__module__.rsplit(".", 1)[1] for p in cm.pricers}
    # one per strategy, and the trainer's bookkeeping (its collectives around the step)
    assert names == {"data", "zero", "tensor", "tensor_nd", "context", "pipeline", "expert", "recompute", "trainer"}
    for p in cm.pricers:
        assert all(callable(getattr(p, m, None)) for m in ("chunk_comm", "memory", "step")), p


def test_the_flush_and_the_bookkeeping_are_step_terms():
    """The pipeline's flush and the trainer's bookkeeping reach the step as their pricers' step terms."""
    spec = preset("gpt3-350m")
    cm = CostModel(spec, get_cluster("h100", 16), "bf16")
    lay = Layout(dp=2, tp=2, pp=4, micro_batch=1, micro_batches=16, grad_accum=spec.global_batch // 32)
    est = cm.estimate(lay)
    flush = cm.pipeline.step(lay, est.chunk_times, est.memory)
    book = cm.trainer.step(lay, est.chunk_times, est.memory)
    assert est.flush_s == flush.flush_s > 0 and book.overhead_s > 0  # tp and pp: the norm's sums, the loss message
    assert est.time["overhead"] == cm.cal.step_overhead_s + book.overhead_s


def test_memory_is_the_pricers_terms_in_order():
    spec = preset("gpt3-350m")
    cm = CostModel(spec, get_cluster("h100", 16), "bf16")
    lay = Layout(dp=2, tp=2, pp=4, micro_batch=1, micro_batches=16, grad_accum=spec.global_batch // 32, zero_stage=1, schedule="zb-h1")
    mem = cm.stage_memory(lay, 0)
    assert list(mem)[:-1] == [k for k in MEMORY_TERMS if k in mem] and list(mem)[-1] == "total"
    assert mem["total"] == sum(v for k, v in mem.items() if k != "total")
    assert mem["captured_grads"] > 0  # the pipeline pricer's term, beside zero's, recompute's and tensor's


def test_a_chunks_collectives_are_the_pricers_summed():
    spec = preset("mixtral-8x7b")
    cm = CostModel(spec, get_cluster("h100", 32), "bf16")
    lay = Layout(dp=1, tp=2, ep=4, cp=2, pp=2, micro_batch=1, micro_batches=8)
    chunk = Chunk(tuple(range(16)), True, False, spec.seq_len // 2)
    parts = cm.chunk_comm_parts(lay, chunk)
    assert [type(p).__name__ for p in (cm.tensor, cm.expert, cm.context)] == ["TensorPricer", "ExpertPricer",
                                                                                "ContextPricer"]
    assert len(parts) == 3 and all(isinstance(p, ChunkComm) for p in parts)
    whole = cm.chunk_comm(lay, chunk)
    assert whole.sent == {"tp": parts[0].sent["tp"], "ep": parts[1].sent["ep"], "cp": parts[2].sent["cp"]}
    assert whole.fwd_s == parts[0].fwd_s + parts[1].fwd_s + parts[2].fwd_s


def _tp_comm(spec, cluster, overlap: bool) -> ChunkComm:
    cm = CostModel(spec, cluster, "fp32")
    lay = Layout(tp=4, sequence_parallel=True, tp_overlap=overlap, micro_batch=1)
    return cm.chunk_comm(lay, Chunk(tuple(range(spec.cfg.n_layer)), True, True, spec.seq_len))


def test_tp_overlap_hides_the_blocks_gathers_behind_a_compute_heavy_layer():
    from tessel.planner.pricing.tensor import exposed_ring
    spec, slow = tiny_spec(), flat_cluster(flops=1e9)  # 1 GFLOP/s: each matmul piece outlasts its transfer
    plain, over = _tp_comm(spec, slow, False), _tp_comm(spec, slow, True)
    cm = CostModel(spec, slow, "fp32")
    pricing = cm.tensor.pricing
    geo = pricing.groups(Layout(tp=4, sequence_parallel=True))["tp"]
    act = spec.seq_len * spec.cfg.d_model * 4
    per_block = pricing.cost("all_gather", act, geo).seconds + pricing.cost("reduce_scatter", act, geo).seconds
    # every dense block's two gathers and two reduce-scatters hidden, both ways; the edges' calls stay
    hidden = 2 * spec.cfg.n_layer * per_block
    assert abs((plain.fwd_s - over.fwd_s) - hidden) < 1e-12 and abs((plain.bwd_s - over.bwd_s) - hidden) < 1e-12
    assert over.fwd_s > 0 and over.sent == plain.sent  # the same bytes, only less of their time exposed
    assert exposed_ring(1.0, 10.0, 4) == 0.0


def test_tp_overlap_never_prices_below_zero_for_a_comm_heavy_layer():
    from tessel.planner.pricing.tensor import exposed_ring
    spec, fast = tiny_spec(), flat_cluster(flops=1e18, bw=1e6)  # compute ~0 beside a 1 MB/s link
    plain, over = _tp_comm(spec, fast, False), _tp_comm(spec, fast, True)
    assert 0 < plain.fwd_s - over.fwd_s < 1e-3 * plain.fwd_s  # nearly nothing to hide behind
    assert over.fwd_s > 0 and over.bwd_s > 0
    for comm, compute in ((1.0, 0.0), (1.0, 0.5), (1.0, 3.0), (0.0, 1.0)):
        assert 0.0 <= exposed_ring(comm, compute, 4) <= comm
    assert exposed_ring(1.0, 0.0, 4) == 1.0 and exposed_ring(1.0, 0.0, 1) == 1.0
