"""Expert parallelism: parity with a single-process MoE model, with and without dropped tokens.

Capacity is counted per forward call on the tokens that the router of that call
sees (GShard's "group"). Under ep/dp each rank routes its own batch shard, so the
single-process reference runs with grad_accum = dp*ep: its accumulation chunks
are exactly the ranks' shards (the sampler hands shard s rows [s*b, (s+1)*b) of
the global batch, and the runner chunks the same way), each chunk routed and
capped on its own. The mean over chunks of (cross-entropy + aux loss) is then
the same number as the mean over ranks, and so are the gradients.
"""

import torch
from torch.testing import assert_close

from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config, whole_over_ep

# the reference routes each rank's shard as one accumulation chunk: per-rank (local) balancing
# statistics (the global scope has its own test, test_global_balance.py)
MOE = ["model.n_experts=4", "model.moe_every=1", "model.aux_loss_coef=0.01", "model.z_loss_coef=0.001",
       "train.steps=3", 'model.aux_loss_scope="local"']
NO_DROP = "model.capacity_factor=4.0"  # capacity = tokens: no expert can overflow
DROP = "model.capacity_factor=0.5"  # room for half the assignments: drops are certain

# (name, parallel layout, model options); one spawn per world size runs its cases in turn
CASES = {
    2: [("ep2-top1-nodrop", ["parallel.ep=2"], [NO_DROP]),
        ("ep2-top1-drop", ["parallel.ep=2"], [DROP])],
    4: [("ep4-top2-nodrop", ["parallel.ep=4"], [NO_DROP, "model.moe_top_k=2"]),
        ("dp2ep2-top2-drop", ["parallel.dp=2", "parallel.ep=2"], [DROP, "model.moe_top_k=2"])],
}

# fp32 throughout. Routing decisions are made on identical numbers in both runs;
# what differs is summation order (all-reduce over ranks vs accumulation over
# chunks, expert rows gathered in another order), a few ulps per step. AdamW
# magnifies that where gradients are tiny. Measured over all cases: losses
# within 5e-7, gradients within 3e-8, weights within 3e-6 after 3 steps. A lost,
# doubled or misrouted token, or expert gradients averaged over the wrong ranks,
# moves losses and the gradient norm by ~1e-3, far outside these bounds.
LOSS_TOL = dict(rtol=1e-5, atol=1e-5)
GRAD_TOL = dict(rtol=1e-4, atol=1e-6)
WEIGHT_TOL = dict(rtol=1e-4, atol=2e-5)


def _train(overrides) -> dict:
    cfg = tiny_config(*overrides)
    trainer, model, _, mesh = build_trainer(cfg)
    named = list(model.named_parameters())
    grads = []  # after reduction and clipping, as the optimizer sees them
    trainer.optimizer.register_step_pre_hook(
        lambda *_: grads.append({n: whole_over_ep(q.grad, q, mesh) for n, q in named}))
    rows = [trainer.train_step(step) for step in range(cfg.train.steps)]
    return {"rows": rows, "grads": grads, "state": {n: whole_over_ep(q, q, mesh) for n, q in named}}


def _run_cases(cases) -> dict:
    return {name: _train([*MOE, *layout, *opts]) for name, layout, opts in cases}


def _shards(layout) -> int:
    n = 1
    for o in layout:
        n *= int(o.split("=")[1])
    return n


def _check(world):
    results = spawn(_run_cases, world, CASES[world])
    for name, layout, opts in CASES[world]:
        ref = _train([*MOE, *opts, f"train.grad_accum={_shards(layout)}"])
        drops = [r["moe/drop_rate"] for r in ref["rows"]]
        assert all(d > 0.05 for d in drops) if DROP in opts else all(d == 0 for d in drops), (name, drops)
        # the run must change the weights, or weight parity would say nothing
        assert ref["grads"][0]["layers.0.mlp.experts.w_up.weight"].abs().max() > 1e-4
        for rank, got in enumerate(results):
            got = got[name]
            for key in ("loss", "moe/aux_loss", "moe/drop_rate", "moe/load/L1/e3", "grad_norm"):
                assert_close(torch.tensor([r[key] for r in got["rows"]]), torch.tensor([r[key] for r in ref["rows"]]),
                             **LOSS_TOL, msg=lambda m: f"{name} rank {rank} {key}: {m}")
            for step, (g, rg) in enumerate(zip(got["grads"], ref["grads"])):
                for n, want in rg.items():
                    assert_close(g[n], want, **GRAD_TOL, msg=lambda m: f"{name} rank {rank} step {step} grad {n}: {m}")
            for n, want in ref["state"].items():
                assert_close(got["state"][n], want, **WEIGHT_TOL, msg=lambda m: f"{name} rank {rank} {n}: {m}")


def test_ep2_matches_single_process():
    _check(2)


def test_ep4_and_dp2_ep2_match_single_process():
    _check(4)
