"""The GPU device model's pricing of GEMMs (a roofline prior, corrected by a measured table), compiled blocks
and the fused loss (no processes, no torch)."""

import json
from dataclasses import replace

import pytest

from tessel.config import ModelConfig
from tessel.parallel.fused_loss.chunks import chunk_tokens
from tessel.planner import gemm
from tessel.planner.cluster import Cluster, get_cluster
from tessel.planner.compute import Stream, backward, block_forward, block_seconds, edge_seconds, op_seconds
from tessel.planner.cost import CostModel
from tessel.planner.gemm import Gemm, GemmTable, efficiency, gemm_seconds, load_table, prior_seconds
from tessel.planner.layout import Layout
from tessel.planner.memory import head_activation_bytes
from tessel.planner.model_spec import from_config, preset

H100 = replace(get_cluster("h100", 1), gemm_table=None)  # the prior alone, whatever table is committed
GPT2 = from_config(ModelConfig(vocab_size=50304, n_layer=12, n_head=12, d_model=768, max_seq_len=1024,
                               tie_embeddings=True), 1024, 16)


def test_gemm_efficiency_rises_with_shape():
    # square GEMMs: small ones fill few SMs and are memory-bound; large ones reach the sustained share
    effs = [efficiency(Gemm(n, n, n), H100, "bf16") for n in (256, 1024, 4096, 16384)]
    assert effs == sorted(effs) and effs[0] < 0.1 < effs[-1]
    assert effs[-1] <= H100.gemm_efficiency  # never above the sustained share of the peak
    # at a fixed M x N, a longer K amortizes each tile's pipeline fill
    assert efficiency(Gemm(4096, 4096, 256), H100, "bf16") < efficiency(Gemm(4096, 4096, 4096), H100, "bf16")


def test_tp8_weight_gradients_split_k_by_the_same_rule():
    # a tp=8 shard of GPT-2's q projection: its weight gradient is M = 768/8 features x N = 768 x K = 16k tokens.
    # Its output is 24 tiles of 64 x 64 (fewer of any larger tile): unsplit, no tiling keeps more than 24 of
    # the 132 SMs busy, an upper bound of 24/132 of the sustained share (padding and L2 feed make it less).
    # Split into K slices the tiles fill the SMs: the prior prices it well above that bound
    g = Gemm(96, 768, 16384)
    unsplit_bound = 24 / H100.sms * H100.gemm_efficiency
    assert efficiency(g, H100, "bf16") > 1.5 * unsplit_bound
    # the same rule prices a tp=1 GEMM: the per-rank shapes of tp=8 come out of CostModel.gemms, each priced
    # by gemm_seconds alone, with no tp-specific factor
    cm = CostModel(preset("gpt3-1.3b"), H100, "bf16")  # d 2048, 16 heads of 128: 256 q features per tp=8 rank
    shards, whole = cm.gemms(Layout(tp=8, micro_batch=1)), cm.gemms(Layout(micro_batch=1))
    assert Gemm(2048, 256, 2048) in shards and Gemm(256, 2048, 2048) in shards  # q and its weight gradient
    assert Gemm(2048, 2048, 2048) in whole and Gemm(256, 2048, 2048) not in whole


def test_persistent_kernels_fill_their_pipeline_once():
    # Hopper's persistent GEMMs: only the first wave waits for its load pipeline. A short-K GEMM of many waves
    # (a tp=8 row-parallel projection: K = d_model / 8) gains; a long-K one barely (its fill is 96 of 5120 K-steps)
    waves = replace(H100, gemm_persistent=False)
    short, long = Gemm(2048, 5120, 640), Gemm(2048, 640, 5120)
    assert prior_seconds(short, H100, "bf16") < 0.95 * prior_seconds(short, waves, "bf16")
    assert prior_seconds(long, H100, "bf16") > 0.97 * prior_seconds(long, waves, "bf16")
    assert not get_cluster("a100").gemm_persistent  # Ampere's kernels are not: every wave fills


def test_measured_table_overrides_the_prior(tmp_path):
    measured, near = Gemm(4096, 4096, 4096), Gemm(4096, 4096, 5120)
    table = GemmTable("NVIDIA H100 80GB HBM3", "2026-11-28", "python benchmarks/gpu_suite.py",
                      ((measured, 2 * prior_seconds(measured, H100, "bf16")),))
    (tmp_path / "h100.json").write_text(json.dumps(table.to_dict()))
    loaded = load_table("h100", tmp_path)
    assert loaded == table and load_table("a100", tmp_path) is None
    cl = replace(H100, gemm_table=loaded)
    # the measured shape costs what was measured; any other the prior times its neighbours' correction (2)
    assert gemm_seconds(measured, cl, "bf16") == pytest.approx(table.points[0][1], rel=1e-12)
    assert gemm_seconds(near, cl, "bf16") == pytest.approx(2 * prior_seconds(near, H100, "bf16"), rel=1e-12)
    # a table of another dtype leaves fp32 GEMMs to the prior; the planner says which priced them
    assert gemm_seconds(near, cl, "fp32") == prior_seconds(near, H100, "fp32")
    assert "measured on NVIDIA H100 80GB HBM3" in gemm.source(cl) and "prior" in gemm.source(H100)
    assert Cluster.from_dict(cl.to_dict()) == cl  # a cluster with its table survives the probe cache's JSON


def test_neighbours_weigh_by_distance():
    a, b = Gemm(1024, 1024, 1024), Gemm(8192, 8192, 8192)
    table = GemmTable("gpu", "d", "c", ((a, 0.5 * prior_seconds(a, H100, "bf16")),
                                        (b, 1.0 * prior_seconds(b, H100, "bf16"))))
    cl = replace(H100, gemm_table=table)
    # a shape beside `a` takes mostly its correction (0.5), one beside `b` mostly b's (1.0)
    assert gemm.correction(Gemm(1100, 1024, 1024), table, cl) < 0.55
    assert gemm.correction(Gemm(8192, 8192, 7800), table, cl) > 0.95


def test_compiled_blocks_cost_less_than_eager_with_the_same_gemms():
    cm, ccm = CostModel(GPT2, H100, "bf16"), CostModel(GPT2, H100, "bf16", compiled=True)
    lay = Layout(micro_batch=16)
    eager, comp = cm.shape(lay, 16384, False), ccm.shape(lay, 16384, False)
    gemms = [[op for op in ops if isinstance(op, Gemm)] for ops in (block_forward(eager)[0], block_forward(comp)[0])]
    assert gemms[0] == gemms[1]  # compilation fuses the memory-bound chains, the GEMMs stay
    f, b, _ = block_seconds(eager, H100, "bf16")
    cf, cb, _ = block_seconds(comp, H100, "bf16")
    assert cf < f and cb < b
    # what compiling saves is memory-bound work: less than all of the eager block's, and more than a quarter
    # of it (rotary's 24 bytes per element become 4, three input casts one, SwiGLU's 5 passes 3)
    fwd, core = block_forward(eager)
    streams = sum(op_seconds(op, H100, "bf16") for op in fwd + core + backward(fwd + core) if isinstance(op, Stream))
    assert 0.25 * streams < (f + b) - (cf + cb) < streams
    # and the whole step: cheaper, but by no more than the memory-bound work there was
    assert ccm.estimate(lay).step_s < cm.estimate(lay).step_s


def test_fused_loss_removes_the_logits_memory_and_their_passes():
    tokens, v, d = 16384, 50304, 768
    eager = head_activation_bytes(GPT2, tokens, 1, "bf16")
    fused = head_activation_bytes(GPT2, tokens, 1, "bf16", fused_loss=True)
    assert eager > tokens * v * 10  # bf16 logits, their fp32 copy and the saved log-softmax: 10 bytes each
    # one chunk of the 16k tokens' logits (the kernel's rule: 1024 tokens, a sixteenth), the head's weight
    # gradient: under a tenth of the eager
    assert chunk_tokens(tokens, d, v) == 1024 and fused < eager / 10
    # twice the tokens add the hidden states' gradient (bf16) and the final norm's two fp32 tensors per token,
    # and the chunk the kernel's rule then takes (still a sixteenth of the tokens: its bound on chunk count)
    more = head_activation_bytes(GPT2, 2 * tokens, 1, "bf16", fused_loss=True)
    grown_chunk = (chunk_tokens(2 * tokens, d, v) - chunk_tokens(tokens, d, v)) * v * (2 + 4 + 2)
    assert more - fused == tokens * d * (2 + 8) + grown_chunk
    cm, fcm = CostModel(GPT2, H100, "bf16"), CostModel(GPT2, H100, "bf16", fused_loss=True)
    lay = Layout(micro_batch=16)
    assert cm.estimate(lay).memory["activations"] - fcm.estimate(lay).memory["activations"] > 0.8 * eager
    # the head's time: the same GEMMs, without the fp32 passes over the logits
    shape, fshape = cm.shape(lay, tokens, False), fcm.shape(lay, tokens, False)
    assert sum(edge_seconds(fshape, v, H100, "bf16", False, True)) < sum(edge_seconds(shape, v, H100, "bf16",
                                                                                          False, True))
    assert [op for op in backward([Gemm(tokens, v, d)])] == [Gemm(tokens, d, v), Gemm(v, d, tokens)]


def test_h200_is_the_h100_chip_with_more_and_faster_memory():
    h100, h200 = get_cluster("h100"), get_cluster("h200")
    assert h200.peak_flops == h100.peak_flops and h200.sms == h100.sms
    assert h200.memory > 1.7 * h100.memory and h200.mem_bandwidth > 1.4 * h100.mem_bandwidth
    spec = preset("gpt3-1.3b")
    lay = Layout(micro_batch=4)
    # a memory-bound share of the step runs faster on H200; never slower
    assert CostModel(spec, h200, "bf16").estimate(lay).step_s < CostModel(spec, h100, "bf16").estimate(lay).step_s


def test_tessel_plan_says_what_priced_the_gemms_and_prices_the_recipes_knobs():
    from typer.testing import CliRunner

    from tessel.commands.cli import app
    base = ["plan", "--model", "gpt3-125m", "--world", "1", "--cluster", "h100", "--layout", "mb=4,ga=64", "--json"]
    reports = [json.loads(CliRunner().invoke(app, base + extra).output)
               for extra in ([], ["--set", "train.compile=blocks", "--set", "train.fused_loss=true"])]
    assert reports[0]["gemms"] == gemm.source(get_cluster("h100"))
    eager, compiled = (r["plans"][0] for r in reports)
    # the recipe's train.compile and train.fused_loss reach the cost model: a faster step, less memory
    assert compiled["step_s"] < eager["step_s"]
    assert compiled["memory_mib"]["activations"] < eager["memory_mib"]["activations"]
