"""Today's router and experts on one device: sigmoid scores normalised over the top-k, group-limited routing, the
bias that balances without an auxiliary loss, shared experts, dropless experts as grouped GEMMs."""

import pytest
import torch
from torch.testing import assert_close

from tessel.config import ModelConfig
from tessel.models.gpt import GPT
from tessel.models.moe import (MoE, Router, bias_routers, grouped_mm, limit_to_groups, padded_mm, per_expert_loop,
                               top_k_gates, update_biases)


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16, n_experts=8, moe_top_k=2,
                capacity_factor=0.0, aux_loss_coef=0.01)
    return ModelConfig(**{**base, **kw})


def test_sigmoid_gates_are_the_chosen_scores_normalised():
    router = Router(_cfg(moe_score="sigmoid", moe_top_k=3))
    logits = torch.randn(5, 8)
    r = router.route(logits)
    scores = logits.sigmoid()
    top = scores.topk(3, dim=-1)
    assert_close(r.expert.view(5, 3), top.indices)
    assert_close(r.gate.view(5, 3), top.values / top.values.sum(-1, keepdim=True))


def test_top1_keeps_its_probability_unless_told_to_normalise():
    probs = torch.tensor([[0.7, 0.2, 0.1]])
    assert_close(top_k_gates(probs, 1)[0], torch.tensor([[0.7]]))
    assert_close(top_k_gates(probs, 1, normalise=True)[0], torch.tensor([[1.0]]))
    assert_close(top_k_gates(probs, 2, normalise=False)[0], torch.tensor([[0.7, 0.2]]))


def test_group_limited_routing_takes_experts_from_the_best_groups_only():
    # 4 groups of 2; group scores (sum of the top 2): 0.9+0.1, 0.5+0.5, 0.95+0.0, 0.3+0.3
    choice = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.95, 0.0, 0.3, 0.3]])
    limited = limit_to_groups(choice, groups=4, limit=2)  # groups 0 (1.0) and 1 (1.0) beat group 2 (0.95)
    assert torch.isinf(limited[0, 4:]).all() and torch.equal(limited[0, :4], choice[0, :4])
    _, experts = top_k_gates(choice, 3, choice=limited)
    assert sorted(experts[0].tolist()) == [0, 2, 3]  # expert 4 scores 0.95 but its group lost


def test_bias_steers_the_choice_not_the_gates():
    router = Router(_cfg(balance="bias", moe_score="sigmoid", moe_top_k=1, moe_norm_topk=False))
    logits = torch.zeros(4, 8)
    logits[:, 0] = 1.0  # every token prefers expert 0
    router.expert_bias[3] = 2.0  # ... until expert 3's bias outbids it
    r = router.route(logits)
    assert (r.expert == 3).all()
    assert_close(r.gate, torch.full((4,), 0.5))  # sigmoid(0): the score, without the bias


def test_bias_moves_by_the_sign_of_the_load_error_of_the_step():
    model = GPT(_cfg(balance="bias", balance_bias_rate=0.1, moe_top_k=1, n_layer=1))
    (router,) = bias_routers(model)
    model(torch.randint(0, 64, (2, 8)))  # two training forwards add up their loads
    model(torch.randint(0, 64, (2, 8)))
    load = router.step_load.clone()
    assert load.sum() == 32
    with torch.no_grad():  # evaluation does not count
        model(torch.randint(0, 64, (2, 8)))
    assert torch.equal(router.step_load, load)
    update_biases([router])
    assert_close(router.expert_bias, 0.1 * torch.sign(load.mean() - load))
    assert router.step_load is None
    assert "layers.0.mlp.router.expert_bias" in model.state_dict()  # the checkpoint carries it


def test_shared_experts_add_to_the_routed_output():
    torch.manual_seed(0)
    moe = MoE(_cfg(n_shared_experts=2))
    assert moe.shared.w_up.weight.shape == (2 * moe.experts.w_up.weight.size(1), 16)
    x = torch.randn(2, 4, 16)
    out = moe(x)
    shared = moe.shared
    del moe.shared
    routed = moe(x)
    assert_close(out, routed + shared(x))


def test_dropless_keeps_every_assignment():
    router = Router(_cfg(moe_top_k=2))
    logits = torch.zeros(32, 8)
    logits[:, 0] = 5.0  # every token's first choice is expert 0: far past any capacity
    r = router.route(logits)
    assert r.token.numel() == 64 and int(r.dropped) == 0


@pytest.mark.parametrize("counts", [[3, 0, 7, 1], [0, 0, 0, 5], [0, 0, 0, 0]])
def test_grouped_experts_equal_the_per_expert_loop(counts):
    """The grouped GEMM (torch._grouped_mm on this CPU) and the padded batched matmul against the loop: outputs
    and gradients. Each output row is the same dot products in each, so they agree to fp32 rounding of the
    kernels' blocking (bit for bit where torch's CPU grouped matmul runs the same kernel)."""
    torch.manual_seed(0)
    moe = MoE(_cfg(n_experts=4))
    x = torch.randn(sum(counts), 16, requires_grad=True)
    c = torch.tensor(counts)
    grouped = moe.experts(x, c)
    ref = per_expert_loop(moe.experts, x, counts)
    assert_close(grouped, ref, rtol=1e-6, atol=1e-7)
    g = torch.randn_like(ref)
    params = [x, *moe.experts.parameters()]
    got, want = torch.autograd.grad(grouped, params, g), torch.autograd.grad(ref, params, g, allow_unused=True)
    for a, b in zip(got, want):
        assert_close(a, torch.zeros_like(a) if b is None else b, rtol=1e-6, atol=1e-7)
    w = moe.experts.w_up.weight.transpose(1, 2)
    assert_close(padded_mm(x, w, c), grouped_mm(x, w, c), rtol=1e-6, atol=1e-7)
    moe.experts(x, c).sum().backward()  # a sum's gradient arrives expanded (stride 0)
