"""Today's MoE under ep, ep x dp and ep x tp: parity with one process (losses, gradients, weights, the balancing
bias after each of 3 steps).

The model is DeepSeek-V3's block in miniature: 8 fine-grained routed experts (d_ff 16) of which each token takes
3, one shared expert, sigmoid scores normalised over the chosen 3, group-limited routing (2 groups of 4 experts,
each token's experts from its best group: under ep2 a group is one ep rank's experts, so each token is sent to
one rank), dropless experts (capacity_factor = 0, the grouped GEMM over variable-size groups), and the
auxiliary-loss-free bias balancing (a complementary aux loss of 1e-3 over the global batch). Dropless with
global balancing statistics, every layout is one process on the whole batch (grad_accum = 1): nothing a rank
decides depends on which tokens share its shard. The bias moves after each step by the sign of each expert's
load error over the global batch, counted on every rank and summed over dp x ep.
"""

import torch
from torch.testing import assert_close

from tessel.models.moe import moe_layers
from tessel.parallel.tensor.tensor_parallel import TPContext, full_tensor
from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config, whole_over_ep

FINE = ["model.n_experts=8", "model.moe_top_k=3", "model.d_ff=16", "model.n_shared_experts=1",
        'model.moe_score="sigmoid"', "model.moe_route_groups=2", "model.moe_route_group_limit=1",
        'model.balance="bias"', "model.balance_bias_rate=0.01", "model.capacity_factor=0.0",
        "model.aux_loss_coef=0.001", "train.steps=3"]
CASES = {2: {"ep2": ["parallel.ep=2"]},
         4: {"dp2_ep2": ["parallel.dp=2", "parallel.ep=2"], "ep2_tp2": ["parallel.ep=2", "parallel.tp=2"]}}

# fp32. The routing makes the same choices on numbers a few ulps apart (tp's split matmuls and the all-reduces
# add in another order than one process, ~1e-7 relative per op); AdamW magnifies ulps where gradients are tiny.
# The bounds of test_expert_parallel.py: a lost or doubled token, a shared expert's gradient reduced over the
# wrong ranks, or a bias updated from one rank's load instead of the global batch's moves the losses by ~1e-3
# and the weights by ~lr = 1e-2. The bias is compared exactly: the loads are integer counts, summed exactly,
# and the update adds +-rate to equal numbers, so any difference is a token routed elsewhere.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=2e-5)


def _train(overrides) -> dict:
    cfg = tiny_config(*FINE, *overrides)
    trainer, model, _, mesh = build_trainer(cfg)
    ctx = TPContext.from_mesh(mesh, cfg.parallel.sequence_parallel)
    named = list(model.named_parameters())

    def whole(t, p):
        return whole_over_ep(full_tensor(t, p, ctx), p, mesh)
    grads, biases = [], []  # gradients as the optimizer sees them; the biases after each step
    trainer.optimizer.register_step_pre_hook(lambda *_: grads.append({n: whole(q.grad, q) for n, q in named}))
    trainer.optimizer.register_step_post_hook(
        lambda *_: biases.append(torch.stack([m.router.expert_bias.clone() for m in moe_layers(model)])))
    rows = [trainer.train_step(step) for step in range(cfg.train.steps)]
    return {"rows": rows, "grads": grads, "biases": biases, "state": {n: whole(q, q) for n, q in named}}


def _run(cases: dict) -> dict:
    return {name: _train(layout) for name, layout in cases.items()}


def _check(world: int) -> None:
    got = spawn(_run, world, CASES[world], timeout=600)
    ref = _train([])
    assert ref["rows"][-1]["moe/drop_rate"] == 0  # dropless
    assert ref["biases"][-1].abs().min() > 0  # every expert's bias moved
    assert ref["grads"][0]["layers.0.mlp.shared.w_up.weight"].abs().max() > 1e-4
    for name in CASES[world]:
        for rank, result in enumerate(got):
            out = result[name]
            for key in ("loss", "grad_norm", "moe/aux_loss", "moe/load/L1/e5"):
                assert_close(torch.tensor([r[key] for r in out["rows"]]), torch.tensor([r[key] for r in ref["rows"]]),
                             **LOSS_TOL, msg=lambda m: f"{name} rank {rank} {key}: {m}")
            for step, (bias, want) in enumerate(zip(out["biases"], ref["biases"], strict=True)):
                assert torch.equal(bias, want), f"{name} rank {rank} step {step} bias: {bias} != {want}"
            for step, (g, rg) in enumerate(zip(out["grads"], ref["grads"], strict=True)):
                for n, want in rg.items():
                    assert_close(g[n], want, **GRAD_TOL, msg=lambda m: f"{name} rank {rank} step {step} grad {n}: {m}")
            for n, want in ref["state"].items():
                assert_close(out["state"][n], want, **WEIGHT_TOL, msg=lambda m: f"{name} rank {rank} {n}: {m}")


def test_fine_grained_shared_sigmoid_bias_ep2_matches_one_process():
    _check(2)


def test_fine_grained_shared_sigmoid_bias_dp2_ep2_and_ep2_tp2_match_one_process():
    _check(4)
