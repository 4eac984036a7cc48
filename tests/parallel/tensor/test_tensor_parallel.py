"""Tensor and sequence parallelism: parity with one process from the same weights.

Two spawns in all (world 2 and world 4, module-scoped fixtures); each loops over
its layouts, so the whole file costs a few process start-ups.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.testing import assert_close

from tessel.config import ConfigError
from tessel.mesh import make_mesh
from tessel.models.gpt import GPT
from tessel.models.plan import GPT_TP_PLAN
from tessel.parallel.norms import clip_grad_norm_
from tessel.parallel.tensor.tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPContext, full_tensor,
                                                    match_plan)
from tessel.apply import parallelize
from tessel.sharding import logical_shape
from tessel.spawn import spawn
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.optim import build_optimizer
from tests.helpers import tiny_config


def local_param_bytes(module: nn.Module) -> int:
    """The bytes of a module's parameters on this rank (a shared parameter once)."""
    return sum(p.numel() * p.element_size() for p in dict.fromkeys(module.parameters()))


STEPS = 3
SHARDED_STYLES = ("colwise", "rowwise", "vocab_embedding", "vocab_head")
# name -> overrides; each runs on its own world size, the reference on one process
LAYOUTS_2 = {
    "tp2": ["parallel.tp=2"],
    "tp2_sp_tied": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.tie_embeddings=true"],
    "tp2_window": ["parallel.tp=2", "model.sliding_window=4"],  # each rank's heads attend within the window
    # packed documents (tessel.models.documents): the mask made from the whole sequence's ids, every rank's
    # heads taking it after SP's gather; id 21 is ~6% of the synthetic tokens and stands in full_logits' prompt
    "tp2_sp_documents": ["parallel.tp=2", "parallel.sequence_parallel=true", "model.vocab_size=32",
                         "model.document_separator=21"],
}
LAYOUTS_4 = {
    "tp4_vocab250": ["parallel.tp=4", "model.vocab_size=250"],  # 250 = 4 * 62 + 2: padded to 252
    "dp2_tp2_tied": ["parallel.dp=2", "parallel.tp=2", "model.tie_embeddings=true"],
    # sequence-parallel norm gradients summed per micro-batch, then averaged over dp
    "dp2_tp2_sp_accum": ["parallel.dp=2", "parallel.tp=2", "parallel.sequence_parallel=true", "train.grad_accum=2"],
}
# fp32 throughout. Tensor parallelism sums partial products in another order
# than one process (all-reduce of per-rank partial matmuls, split softmax
# sums), so results differ by fp32 rounding: measured loss differences <= 5e-7
# and gradient differences <= 2e-8 absolute (the largest gradients are ~1e-2).
# AdamW's first steps move a weight by ~lr * g / |g| whatever |g| is, so for
# the few entries whose gradient is ~1e-9 a rounding difference of 1e-10 in g
# changes their step materially: measured weight differences reach 8e-6 at
# lr = 1e-3 (most stay below 1e-7). WEIGHT_TOL's 5e-5 is 1/20 of one step; a
# real bug (a missing or doubled all-reduce, a wrong shard) changes gradients
# by O(1) relative and weights by ~lr, far outside these tolerances. A scaled
# gradient would slip past Adam's scale invariance, which is why gradients and
# the gradient norm are compared directly.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)
NORM_TOL = dict(rtol=1e-5, atol=0.0)  # a sum of squares in another order: fp32 rounding only


def _run(overrides: list[str]) -> dict:
    """3 optimizer steps with the real parallelize(); returns gathered (unsharded) results."""
    cfg = tiny_config(*overrides, "train.lr=1e-3")
    p = cfg.parallel
    mesh = make_mesh({"pp": p.pp, "dp": p.dp, "ep": p.ep, "tp": p.tp}, order=p.rank_order)
    torch.manual_seed(cfg.train.seed)
    model = GPT(cfg.model)
    sharded = [n for n, s in match_plan(model, GPT_TP_PLAN).items() if s in SHARDED_STYLES]
    full_bytes = {n: local_param_bytes(model.get_submodule(n)) for n in sharded}
    runner = parallelize(model, mesh, cfg)
    ctx = TPContext.from_mesh(mesh, p.sequence_parallel)
    params = runner.parameters()
    opt = build_optimizer(params, cfg.train)
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    shard, shards = mesh.local_rank_in("dp", "ep"), mesh.size("dp", "ep")
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, shard, shards)
    out = {"losses": [], "norms": [], "full_bytes": full_bytes,
           "weights0": {n: full_tensor(q, q, ctx) for n, q in model.named_parameters()},
           "local_bytes": {n: local_param_bytes(model.get_submodule(n)) for n in sharded}}
    for step in range(STEPS):
        x, y = sampler.next()
        if cfg.model.document_separator is not None:  # packed documents: how many boundaries the batches held
            out["separators"] = out.get("separators", 0) + int((x == cfg.model.document_separator).sum())
        loss = runner.forward_backward(x, y)
        group = mesh.group("dp", "ep")
        if group is not None:  # each dp rank saw its slice of the batch
            dist.all_reduce(loss, group=group)
            loss = loss / shards
        out["losses"].append(loss.item())
        if step == 0:
            out["grads"] = {n: full_tensor(q.grad, q, ctx) for n, q in model.named_parameters()}
            out["padding_grads"] = _padding_rows(model, "grad")
        out["norms"].append(clip_grad_norm_(params, cfg.train.grad_clip, mesh).item())
        opt.step()
        opt.zero_grad(set_to_none=False)
    out["weights"] = {n: full_tensor(q, q, ctx) for n, q in model.named_parameters()}
    out["padding_weights"] = _padding_rows(model, "data")
    with torch.no_grad():  # sampling path: whole-vocabulary logits for a prompt of odd length
        prompt = torch.arange(5).unsqueeze(0) * 7 % cfg.model.vocab_size
        out["full_logits"] = runner.full_logits(prompt)
    return out


def _padding_rows(model: nn.Module, what: str) -> dict:
    """The rows of this rank's vocabulary shards that lie past the real vocabulary."""
    out = {}
    for n, q in model.named_parameters():
        logical = logical_shape(q)
        if logical is not None:
            rank = int(getattr(model.get_submodule(n.rpartition(".")[0]), "ctx").rank)
            first_pad = max(0, logical[0] - rank * q.size(0))  # local index of the first padded row
            out[n] = getattr(q, what)[first_pad:].detach().clone()
    return out


def _split_linear_pair(sequence_parallel: bool) -> dict:
    """y = row(col(x)) on a split nn.Linear pair vs the whole pair on one rank."""
    mesh = make_mesh({"tp": dist.get_world_size()})
    ctx = TPContext.from_mesh(mesh, sequence_parallel)
    torch.manual_seed(0)
    first, second = nn.Linear(8, 6), nn.Linear(6, 4)
    x = torch.randn(2, 4, 8, requires_grad=True)  # (B, T, C), the same on every rank
    col, row = ColumnParallelLinear.from_linear(first, ctx), RowParallelLinear.from_linear(second, ctx)
    x_in = x.chunk(ctx.size, dim=1)[ctx.rank] if sequence_parallel else x  # sequence-sharded input
    y = row(col(x_in))
    y.pow(2).sum().backward()
    x_grad = x.grad.chunk(ctx.size, dim=1)[ctx.rank] if sequence_parallel else x.grad  # zero elsewhere
    return {"y": y.detach(), "x_grad": x_grad, "rank": ctx.rank, "size": ctx.size,
            "col_w": full_tensor(col.weight.grad, col.weight, ctx), "col_b": full_tensor(col.bias.grad, col.bias, ctx),
            "row_w": full_tensor(row.weight.grad, row.weight, ctx), "row_b": row.bias.grad}


def _world2() -> dict:
    out = {name: _run(o) for name, o in LAYOUTS_2.items()}
    out["linear"] = _split_linear_pair(False)
    out["linear_sp"] = _split_linear_pair(True)
    return out


def _world4() -> dict:
    return {name: _run(o) for name, o in LAYOUTS_4.items()}


@pytest.fixture(scope="module")
def world2():
    return spawn(_world2, 2)


@pytest.fixture(scope="module")
def world4():
    return spawn(_world4, 4)


@pytest.fixture(scope="module")
def references():
    return {name: _run([o for o in ov if not o.startswith("parallel.")])
            for name, ov in {**LAYOUTS_2, **LAYOUTS_4}.items()}


def _check_parity(results: list[dict], ref: dict) -> None:
    for rank, got in enumerate(results):
        where = lambda n: (lambda m: f"rank {rank} {n}: {m}")  # noqa: E731
        assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **LOSS_TOL, msg=where("loss"))
        assert got["grads"].keys() == ref["grads"].keys()
        for n, g in ref["grads"].items():
            assert_close(got["grads"][n], g, **GRAD_TOL, msg=where(f"grad {n}"))
        for n, w in ref["weights"].items():
            assert_close(got["weights"][n], w, **WEIGHT_TOL, msg=where(f"weight {n}"))
    # the reference must actually move, or weight parity would be trivially true
    moved = max((ref["weights"][n] - w0).abs().max().item() for n, w0 in ref["weights0"].items())
    assert moved > 1e-3


@pytest.mark.parametrize("name", list(LAYOUTS_2))
def test_parity_world2(world2, references, name):
    _check_parity([r[name] for r in world2], references[name])
    if "documents" in name:  # the batches held documents to keep apart, or the mask changed nothing
        assert references[name]["separators"] >= STEPS * 4


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_parity_world4(world4, references, name):
    _check_parity([r[name] for r in world4], references[name])


@pytest.mark.parametrize("name", list(LAYOUTS_2) + list(LAYOUTS_4))
def test_global_grad_norm_equals_single_process(world2, world4, references, name):
    results = world2 if name in LAYOUTS_2 else world4
    for got in results:
        # every rank holds the same global norm: shards counted once, replicas not tp times
        assert_close(torch.tensor(got[name]["norms"]), torch.tensor(references[name]["norms"]), **NORM_TOL)


@pytest.mark.parametrize("name", list(LAYOUTS_2) + list(LAYOUTS_4))
def test_full_logits_match_single_process(world2, world4, references, name):
    results = world2 if name in LAYOUTS_2 else world4
    ref = references[name]["full_logits"]
    for got in results:
        assert got[name]["full_logits"].shape == ref.shape  # whole vocabulary, padding dropped
        assert_close(got[name]["full_logits"], ref, rtol=1e-4, atol=1e-5)  # rounding of split sums


@pytest.mark.parametrize("name", ["tp2", "tp4_vocab250"])
def test_sharded_layers_hold_one_tpth_of_the_bytes(world2, world4, name):
    results = world2 if name in LAYOUTS_2 else world4
    tp = len(results)  # tp-only layouts
    for got in results:
        for layer, full in got[name]["full_bytes"].items():
            local = got[name]["local_bytes"][layer]
            if layer in ("tok_emb", "lm_head"):  # vocabulary rows padded up to a multiple of tp
                vocab = 250 if "vocab250" in name else 256
                padded_rows = -(-vocab // tp) * tp
                assert local == full // vocab * padded_rows // tp, layer
            else:
                assert local * tp == full, layer


def test_vocabulary_padding_stays_zero(world4):
    # vocab 250 over tp=4: 63 rows a rank, the last rank holds 61 real rows and 2 padded ones
    padded = [r["tp4_vocab250"] for r in world4]
    assert sum(t.size(0) for r in padded for t in r["padding_weights"].values()) == 2 * 2  # emb + head
    for r in padded:
        for what in ("padding_grads", "padding_weights"):
            for n, t in r[what].items():
                assert torch.count_nonzero(t) == 0, f"{what} {n}"  # never looked up, masked from the loss


def test_split_linear_pair_matches_whole(world2):
    """f / g (and the sequence-parallel g / g-bar) around an nn.Linear pair split column- then row-wise."""
    torch.manual_seed(0)
    first, second = nn.Linear(8, 6), nn.Linear(6, 4)
    x = torch.randn(2, 4, 8, requires_grad=True)
    y = second(first(x))
    y.pow(2).sum().backward()
    for r in world2:
        for key in ("linear", "linear_sp"):
            got = r[key]
            mine = (lambda t: t.chunk(got["size"], dim=1)[got["rank"]]) if key == "linear_sp" else (lambda t: t)
            # two 8- and 6-term dot products split in halves: fp32 rounding only
            tol = dict(rtol=1e-5, atol=1e-6)
            assert_close(got["y"], mine(y.detach()), **tol)
            assert_close(got["x_grad"], mine(x.grad), **tol)
            assert_close(got["col_w"], first.weight.grad, **tol)
            assert_close(got["col_b"], first.bias.grad, **tol)
            assert_close(got["row_w"], second.weight.grad, **tol)
            assert_close(got["row_b"], second.bias.grad, **tol)


def test_sequence_parallel_without_tp_is_rejected():
    with pytest.raises(ConfigError, match="parallel.sequence_parallel"):
        tiny_config("parallel.sequence_parallel=true")


def test_plan_is_data_and_is_checked():
    import ast
    from pathlib import Path

    import tessel.models
    for f in Path(tessel.models.__file__).parent.glob("*.py"):  # models never import parallel
        for node in ast.walk(ast.parse(f.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.startswith("tessel.parallel") for n in names), f
    model = GPT(tiny_config().model)
    styles = match_plan(model, GPT_TP_PLAN)
    assert styles["layers.1.attn.wk"] == "colwise" and styles["layers.0.mlp.w_down"] == "rowwise"
    with pytest.raises(ValueError, match="match no module"):
        match_plan(model, {**GPT_TP_PLAN, "layers.*.attn.w_typo": "colwise"})
    with pytest.raises(ValueError, match="no enclosing module"):
        match_plan(model, {k: v for k, v in GPT_TP_PLAN.items() if k != "layers.*.mlp"})
    with pytest.raises(ValueError, match="unknown style"):
        match_plan(model, {"lm_head": "diagonal"})


def test_moe_plan_keeps_sequence_parallel_norms():
    """An all-MoE model: the feed-forward is replicated, its norm still sequence-parallel
    (a plain norm on 1/tp of the tokens would leave its weight gradient partial)."""
    from tessel.models.plan import gpt_tp_plan
    model = GPT(tiny_config("model.n_experts=2").model)
    styles = match_plan(model, gpt_tp_plan([0, 1], 2))
    assert styles["layers.0.mlp"] == "replicate" and styles["layers.1.mlp_norm"] == "sequence_norm"


def test_full_logits_pads_or_trims_prompts_under_sequence_parallelism():
    from tessel.parallel.tensor.tensor_parallel import FullLogits
    seen = []

    def fake_model(idx):  # records what the sharded model would be given; logits = position
        seen.append(idx.clone())
        return idx.float().unsqueeze(-1).expand(*idx.shape, 6)  # (B, T, 6 = padded vocab)

    ctx = TPContext(group=None, size=4, rank=0, sequence_parallel=True)  # no peers needed: shapes only
    logits = FullLogits(fake_model, ctx, vocab_size=5, max_seq_len=8)(torch.arange(1, 6).unsqueeze(0))
    assert seen[-1].tolist() == [[1, 2, 3, 4, 5, 0, 0, 0]]  # padded on the right to 8
    assert logits.shape == (1, 5, 5) and logits[0, :, 0].tolist() == [1, 2, 3, 4, 5]
    logits = FullLogits(fake_model, ctx, vocab_size=5, max_seq_len=8)(torch.arange(1, 11).unsqueeze(0))
    assert seen[-1].tolist() == [[3, 4, 5, 6, 7, 8, 9, 10]]  # past max_seq_len: oldest tokens dropped
    assert logits.shape == (1, 8, 5) and logits[0, -1, 0].item() == 10
