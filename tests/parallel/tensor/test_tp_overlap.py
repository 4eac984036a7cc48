"""parallel.tp_overlap: the ring-decomposed gather/scatter + matmuls (tessel.parallel.tensor.overlap) against
plain tensor parallelism on the same ranks, from the same weights and batches.

Two spawns (world 2 and world 4); each loops over its layouts, running every layout twice, plain and
overlapped, in the same process group. Each rank compares its own shards (the same sharding either way),
so no gathering is needed: losses of 3 steps, gradients of the first, weights after the third. The plain
runs are themselves held to one process by tests/parallel/tensor/test_tensor_parallel.py.
"""

import collections
import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing import assert_close

from tessel.config import ConfigError
from tessel.parallel.tensor import comm, overlap
from tessel.parallel.tensor.tensor_parallel import ColumnParallelLinear
from tessel.parallel.tensor_nd import summa
from tessel.spawn import spawn
from tessel.train.data import BatchSampler, load_tokens
from tessel.train.optim import build_optimizer
from tests.helpers import build_runner, tiny_config, write_configs

STEPS = 3
SP = ["parallel.sequence_parallel=true"]
LAYOUTS_2 = {"tp2_sp": ["parallel.tp=2", *SP],
             "tp2_sp_tied_bf16": ["parallel.tp=2", *SP, "model.tie_embeddings=true", "train.precision='bf16'"]}
# Hugging Face families, whose regions are hooks on transformers' own modules: Llama's separate q, k, v and
# gate, up (one ring feeding several layers), recomputed; GPT-2's Conv1D layers ([in, out]) and fused q|k|v
HF = {"llama": {"model_type": "llama", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "bos_token_id": 1, "eos_token_id": 2},
      "gpt2": {"model_type": "gpt2", "vocab_size": 128, "n_embd": 32, "n_layer": 2, "n_head": 4, "n_positions": 64,
               "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "bos_token_id": 0, "eos_token_id": 0}}
HF_LAYOUTS_2 = {"hf_llama_tp2_sp_recompute": ("llama", ["parallel.tp=2", *SP, "parallel.recompute=true"]),
                "hf_gpt2_tp2_sp": ("gpt2", ["parallel.tp=2", *SP])}
LAYOUTS_4 = {"tp4_sp": ["parallel.tp=4", *SP],
             "dp2_tp2_sp": ["parallel.dp=2", "parallel.tp=2", *SP],
             "pp2_tp2_sp": ["parallel.pp=2", "parallel.tp=2", *SP, "parallel.micro_batches=2"],
             "grid2d": ["parallel.tp=4", "parallel.tp_mode='2d'"]}  # SUMMA on 2 x 2, its broadcasts prefetched
# fp32. The overlapped reduce-scatter adds the tp partial sums of each chunk in ring order (from rank d + 1
# round to d) where gloo's collective uses its own order, and the weight gradients are summed chunk by chunk
# rather than in one matmul: each sum of k fp32 terms may move by ~k * 2^-24 relative to its largest term,
# i.e. ~1e-7 relative for tp <= 4 and these widths (<= 128 terms a dot product). Losses then agree to ~1e-6
# and gradients to ~1e-7 absolute (the largest are ~1e-2). AdamW's early steps move a weight by ~lr whatever
# |g| is, so an entry whose gradient is ~1e-9 can move by a fraction of lr = 1e-3 when its rounding differs:
# the weights' 5e-5 is 1/20 of a step, as in test_tensor_parallel.py. A real bug (a chunk in the wrong place,
# a partial sum dropped or doubled) moves losses and gradients by O(1) relative.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-7)
WEIGHT_TOL = dict(rtol=1e-4, atol=5e-5)
# bf16 autocast: both paths round each matmul output to bf16 (8 bits of mantissa, 2^-8 ~ 4e-3 relative), and
# a chunk's sums round in another order, so one ulp of bf16 on a loss ~5, and on the gradients a few ulps of the
# largest (~2e-2: an ulp is 2^-7 * 2e-2 ~ 1.6e-4; measured 1.8e-4), carried back through the layers
BF16_LOSS_TOL = dict(rtol=2e-2, atol=2e-2)
BF16_GRAD_TOL = dict(rtol=5e-2, atol=5e-4)
# and a weight whose bf16 gradient is near zero can take AdamW steps of ~lr in other directions: 3 steps of
# lr = 1e-3 bound that by 3e-3 (measured 2.1e-3 on 15 of 4096 embedding entries); a bug moves all of them
BF16_WEIGHT_TOL = dict(rtol=1e-2, atol=4e-3)
# the logits sampled after the 3 steps: sums over d_model = 32 of weights within WEIGHT_TOL, so ~1e-4 in fp32;
# in bf16 a logit of magnitude ~2 has an ulp of 2^-7 * 2 ~ 1.6e-2, and the weights differ by up to 4e-3
LOGIT_TOL = dict(rtol=1e-4, atol=1e-4)
BF16_LOGIT_TOL = dict(rtol=2e-2, atol=2e-2)


def _run(overrides: list[str]) -> dict:
    """3 optimizer steps through parallelize(); this rank's losses, first gradients and final weights."""
    cfg = tiny_config(*overrides, "train.lr=1e-3")
    model, runner, mesh = build_runner(cfg)
    params = runner.parameters()
    opt = build_optimizer(params, cfg.train)
    tokens = load_tokens(cfg.data, cfg.model.vocab_size, seed=cfg.train.seed)
    shard, shards = mesh.local_rank_in("dp", "ep"), mesh.size("dp", "ep")
    sampler = BatchSampler(tokens.train, cfg.train.seq_len, cfg.train.global_batch, cfg.train.seed, shard, shards)
    named = runner.named_parameters() if mesh.size("pp") > 1 else dict(model.named_parameters())
    out = {"losses": []}
    for step in range(STEPS):
        x, y = sampler.next()
        out["losses"].append(float(runner.forward_backward(x, y)))
        if step == 0:
            out["grads"] = {n: q.grad.detach().clone() for n, q in named.items() if q.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=False)
    out["weights"] = {n: q.detach().clone() for n, q in named.items()}
    if mesh.size("pp") == 1:
        with torch.no_grad():  # sampling: whole-vocabulary logits of a prompt tp does not divide
            out["full_logits"] = runner.full_logits(torch.arange(5).unsqueeze(0) * 7 % cfg.model.vocab_size)
    return out


def _pair(overrides: list[str]) -> dict:
    plain = _run(overrides)
    with _counting() as counts:
        over = _run([*overrides, "parallel.tp_overlap=true"])
    return {"plain": plain, "overlap": {**over, "counts": counts}}


@contextlib.contextmanager
def _counting():
    """Counts of the rings run and of the column layers that took an output their region made (not a
    fallback matmul on the gathered input): the overlapped path must be the one that ran."""
    counts = collections.Counter()
    ring_gather, ring_scatter, linear = overlap.ring_gather, overlap.ring_reduce_scatter, ColumnParallelLinear._linear
    bcast = summa._bcast

    def prefetched(*args, async_op=False):
        counts["prefetched"] += async_op
        return bcast(*args, async_op=async_op)

    def took(layer, x):
        counts["columns"] += 1
        counts["made"] += layer.pending is not None and layer.pending[0] is x
        return linear(layer, x)

    overlap.ring_gather = lambda *a: counts.update(["gathers"]) or ring_gather(*a)
    overlap.ring_reduce_scatter = lambda *a: counts.update(["scatters"]) or ring_scatter(*a)
    ColumnParallelLinear._linear, summa._bcast = took, prefetched
    try:
        yield counts
    finally:
        overlap.ring_gather, overlap.ring_reduce_scatter = ring_gather, ring_scatter
        ColumnParallelLinear._linear, summa._bcast = linear, bcast


def _functions() -> dict:
    """The two autograd functions alone against the collectives they decompose, on random operands: two
    column linears (one with a bias) sharing one gathered input that something else also uses, and a row
    linear; forward outputs and every gradient."""
    group, rank = dist.group.WORLD, dist.get_rank()
    torch.manual_seed(0)
    x, w1, b1, w2, w3 = (torch.randn(*s) for s in ((2, 8, 6), (5, 6), (5,), (3, 6), (6, 4)))
    shard = x.chunk(dist.get_world_size(), 1)[rank].clone()
    out = {}
    for name, overlapped in (("plain", False), ("overlap", True)):
        leaves = [t.clone().requires_grad_() for t in (shard, w1, b1, w2, w3)]
        s, v1, c1, v2, v3 = leaves
        if overlapped:
            full, y1, y2 = overlap.gather_linear(s, [v1, v2], [c1, None], 1, group)
            z = overlap.linear_reduce_scatter(y1[..., :4], v3, 1, group)
        else:
            full = comm.gather_seq(s, 1, group)
            y1, y2 = F.linear(full, v1, c1), F.linear(full, v2)
            z = comm.reduce_scatter_seq(F.linear(y1[..., :4], v3), 1, group)
        loss = z.pow(2).sum() + y2.sin().sum() + full.pow(3).sum()  # the gathered input used outside too
        loss.backward()
        out[name] = {"z": z.detach(), "y2": y2.detach(), "grads": [t.grad for t in leaves]}
    return out


def _world2(paths: dict[str, str]) -> dict:
    hf = {name: _pair([f'model.hf_config="{paths[kind]}"', *o]) for name, (kind, o) in HF_LAYOUTS_2.items()}
    return {"functions": _functions(), **{name: _pair(o) for name, o in LAYOUTS_2.items()}, **hf}


def _world4() -> dict:
    return {"functions": _functions(), **{name: _pair(o) for name, o in LAYOUTS_4.items()}}


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    return spawn(_world2, 2, write_configs(tmp_path_factory.mktemp("hf"), HF), timeout=600)


@pytest.fixture(scope="module")
def world4():
    return spawn(_world4, 4)


def _check(results: list[dict], name: str) -> None:
    bf16 = "bf16" in name
    loss_tol, grad_tol, weight_tol = ((BF16_LOSS_TOL, BF16_GRAD_TOL, BF16_WEIGHT_TOL) if bf16
                                      else (LOSS_TOL, GRAD_TOL, WEIGHT_TOL))
    for rank, got in enumerate(results):
        plain, over = got[name]["plain"], got[name]["overlap"]
        where = lambda n: (lambda m: f"rank {rank} {name} {n}: {m}")  # noqa: E731
        assert_close(torch.tensor(over["losses"]), torch.tensor(plain["losses"]), **loss_tol, msg=where("loss"))
        assert over["grads"].keys() == plain["grads"].keys() and plain["grads"]
        counts = over["counts"]
        if "grid" in name:  # every SUMMA step's panels broadcast ahead
            assert counts["prefetched"] > 0 and not counts["gathers"], where("panels")(counts)
        else:  # every block's 5 column layers took their region's output; rings both ways
            assert counts["made"] >= counts["columns"] - 2 * STEPS > 0, where("columns")(counts)
            assert counts["gathers"] > 0 and counts["scatters"] > 0, where("rings")(counts)
        for n, g in plain["grads"].items():
            assert_close(over["grads"][n], g, **grad_tol, msg=where(f"grad {n}"))
        for n, w in plain["weights"].items():
            assert_close(over["weights"][n], w, **weight_tol, msg=where(f"weight {n}"))
        if "full_logits" in plain:
            assert_close(over["full_logits"], plain["full_logits"], **(BF16_LOGIT_TOL if bf16 else LOGIT_TOL),
                         msg=where("full logits"))


def _check_functions(results: list[dict]) -> None:
    for got in results:
        plain, over = got["functions"]["plain"], got["functions"]["overlap"]
        assert_close(over["z"], plain["z"], rtol=1e-5, atol=1e-6)
        assert_close(over["y2"], plain["y2"], rtol=1e-5, atol=1e-6)
        for g_over, g_plain in zip(over["grads"], plain["grads"]):
            assert_close(g_over, g_plain, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", [*LAYOUTS_2, *HF_LAYOUTS_2])
def test_overlap_equals_plain_world2(world2, name):
    _check(world2, name)


@pytest.mark.parametrize("name", list(LAYOUTS_4))
def test_overlap_equals_plain_world4(world4, name):
    _check(world4, name)


def test_functions_equal_the_collectives(world2, world4):
    _check_functions(world2)
    _check_functions(world4)


@pytest.mark.parametrize("overrides, words", [
    (["parallel.tp_overlap=true"], "tp > 1"),
    (["parallel.tp=2", "parallel.tp_overlap=true"], "sequence_parallel"),
    (["parallel.tp=8", "parallel.tp_mode='3d'", "parallel.tp_overlap=true"], "3d"),
    (["parallel.tp=2", *SP, "parallel.tp_overlap=true", "train.compile='blocks'"], "compile"),
    (["parallel.pp=2", "parallel.tp=2", *SP, "parallel.tp_overlap=true", "parallel.schedule='zb-h1'"], "zb-h1"),
])
def test_refusals(overrides, words):
    from tessel.config.check import check_layout
    with pytest.raises(ConfigError, match=words):
        check_layout(tiny_config(*overrides))
