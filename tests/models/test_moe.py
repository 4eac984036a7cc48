"""MoE block on one device: router maths on hand-made logits, and the block itself."""

import math

import pytest
import torch
from torch.testing import assert_close

from tessel.config import ModelConfig
from tessel.models.gpt import GPT, cross_entropy
from tessel.models.moe import (MoE, Router, assign_slots, capacity, load_balancing_loss, moe_layers, top_k_gates,
                               with_aux_losses)


def _cfg(**kw) -> ModelConfig:
    base = dict(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16, n_experts=4, moe_top_k=1,
                capacity_factor=1.0, aux_loss_coef=0.01)
    return ModelConfig(**{**base, **kw})


def _logits_choosing(experts: list[int], n_experts: int = 4, margin: float = 5.0) -> torch.Tensor:
    """Router logits whose argmax per token is the given expert."""
    logits = torch.zeros(len(experts), n_experts)
    logits[torch.arange(len(experts)), torch.tensor(experts)] = margin
    return logits


def test_random_routing_needs_top2():
    from tessel.config import ConfigError, build_config
    with pytest.raises(ConfigError) as err:
        build_config({}, ["model.n_experts=4", "model.moe_random_routing=true"])
    assert err.value.field == "model.moe_random_routing"


def test_capacity_formula():
    assert capacity(16, 4, 1.0) == 4
    assert capacity(16, 4, 1.25) == 5  # ceil(5.0)
    assert capacity(10, 4, 1.0) == 3  # ceil(2.5)
    assert capacity(7, 8, 0.5) == 1  # ceil(0.4375)


def test_aux_loss_is_alpha_under_uniform_routing():
    alpha, E, N = 0.037, 4, 32
    # uniform probabilities (a zero router) and an evenly spread first choice: f_i = P_i = 1/E
    probs = torch.full((N, E), 1 / E)
    first = torch.arange(N) % E
    assert_close(load_balancing_loss(probs, first, alpha), torch.tensor(alpha))
    # through the router: zero weights give uniform probabilities; whatever the argmax
    # tie-break, sum_i f_i * (1/E) = 1/E, so the loss is alpha again
    router = Router(_cfg(aux_loss_coef=alpha))
    torch.nn.init.zeros_(router.weight)
    assert_close(router(torch.randn(N, 16)).aux_loss, torch.tensor(alpha))


def test_aux_loss_grows_with_imbalance():
    # everything to expert 0 with all probability on it: alpha * E * 1 * 1
    probs = torch.zeros(8, 4)
    probs[:, 0] = 1
    assert_close(load_balancing_loss(probs, torch.zeros(8, dtype=torch.long), 0.01), torch.tensor(0.04))


def test_capacity_drops_latest_tokens_of_an_overfull_expert():
    # 8 tokens, 4 experts, factor 1 -> capacity 2. Expert 0 is chosen by tokens 0,1,3,6.
    choices = [0, 0, 1, 0, 2, 3, 0, 1]
    router = Router(_cfg(capacity_factor=1.0))
    r = router.route(_logits_choosing(choices))
    assert r.load.tolist() == [4, 2, 1, 1]
    assert int(r.dropped) == 2  # tokens 3 and 6: over expert 0's two slots
    assert sorted(r.token.tolist()) == [0, 1, 2, 4, 5, 7]
    assert r.expert.tolist() == [choices[t] for t in r.token.tolist()]
    # a larger factor keeps everything
    r = Router(_cfg(capacity_factor=2.0)).route(_logits_choosing(choices))
    assert int(r.dropped) == 0 and r.token.numel() == 8


def test_top2_first_choices_take_slots_before_second_choices():
    # capacity 1 per expert (4 tokens, 4 experts, factor 1)
    experts = torch.tensor([[0, 1], [1, 0], [2, 0], [3, 2]])
    keep, pos = assign_slots(experts, 4, cap=1)
    # every first choice lands (experts 0..3 once each); every second choice finds its expert full
    assert keep[:, 0].all() and not keep[:, 1].any()
    assert pos[:, 0].tolist() == [0, 0, 0, 0]
    assert pos[:, 1].tolist() == [1, 1, 2, 1]  # after the one first choice of 1, 0 (then 0 again), 2
    keep, _ = assign_slots(experts, 4, cap=2)
    # expert 0 gets token 0 (first choice), then token 1 (second): token 2's second choice is its third
    assert keep[:, 1].tolist() == [True, True, False, True]


def test_top2_gates_are_renormalised():
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.1], [0.1, 0.2, 0.6, 0.1]])
    gates, experts = top_k_gates(probs, 2)
    assert experts.tolist() == [[0, 1], [2, 1]]
    assert_close(gates, torch.tensor([[0.5 / 0.8, 0.3 / 0.8], [0.6 / 0.8, 0.2 / 0.8]]))
    assert_close(gates.sum(-1), torch.ones(2))


def test_random_routing_skips_second_expert_with_probability_one_minus_2g2():
    torch.manual_seed(0)
    N = 20000
    probs = torch.tensor([0.6, 0.3, 0.05, 0.05]).expand(N, 4)  # g2 = 0.3/0.9 = 1/3 -> keep 2/3
    gates, experts = top_k_gates(probs, 2, random_second=True)
    kept = (experts[:, 1] >= 0).float().mean().item()
    assert abs(kept - 2 / 3) < 0.02  # binomial std ~ 0.0033
    assert (gates[experts[:, 1] < 0, 1] == 0).all()
    keep, _ = assign_slots(experts[:8], 4, cap=100)
    assert (keep[:, 1] == (experts[:8, 1] >= 0)).all()  # skipped choices take no slot


def test_moe_equals_dense_evaluation_of_its_experts():
    """Local dispatch: out = sum over kept (token, expert) of gate * SwiGLU_e(x_token)."""
    torch.manual_seed(0)
    moe = MoE(_cfg(moe_top_k=2, capacity_factor=0.75))
    x = torch.randn(2, 8, 16)
    out = moe(x)
    flat = x.reshape(-1, 16)
    r = moe.router(flat)
    assert int(r.dropped) > 0  # the case must actually drop something
    w = moe.experts
    ref = torch.zeros_like(flat)
    for t, e, g in zip(r.token.tolist(), r.expert.tolist(), r.gate):
        h = torch.nn.functional.silu(flat[t] @ w.w_gate.weight[e].t()) * (flat[t] @ w.w_up.weight[e].t())
        ref[t] += g * (h @ w.w_down.weight[e].t())
    assert_close(out.reshape(-1, 16), ref, rtol=1e-5, atol=1e-6)  # fp32, summation order only
    dropped_tokens = set(range(16)) - set(r.token.tolist())
    for t in dropped_tokens:
        assert (out.reshape(-1, 16)[t] == 0).all()  # only the residual carries it on


def test_aux_loss_reaches_the_training_loss_and_the_router():
    torch.manual_seed(0)
    model = GPT(_cfg(n_layer=2, moe_every=1, aux_loss_coef=0.5, z_loss_coef=0.1))
    assert len(moe_layers(model)) == 2
    idx = torch.randint(0, 64, (2, 8))
    loss_fn = with_aux_losses(cross_entropy, model)
    logits = model(idx)
    total = loss_fn(logits, idx)
    aux = sum(m.aux_loss for m in moe_layers(model))
    assert_close(total, cross_entropy(logits, idx) + aux)
    assert aux.item() > 0
    total.backward()
    assert moe_layers(model)[0].router.weight.grad.abs().sum() > 0
    with torch.no_grad():  # validation: plain cross-entropy
        logits = model(idx)
        assert_close(loss_fn(logits, idx), cross_entropy(logits, idx))


def test_stats_count_training_forwards_only():
    moe = MoE(_cfg(capacity_factor=0.5))
    x = torch.randn(1, 16, 16)
    moe(x)
    moe(x)
    with torch.no_grad():
        moe(x)
    s = moe.pop_stats()
    assert s["forwards"].item() == 2 and s["load"].sum().item() == 32
    # 4 experts x capacity 2 = 8 slots for 16 tokens: at least 8 dropped per forward
    assert s["dropped"].item() >= 2 * (16 - 4 * capacity(16, 4, 0.5))
    assert moe.pop_stats() == {}


@pytest.mark.parametrize("k", [1, 2])
def test_flops_and_params_of_the_moe_model(k):
    cfg = _cfg(moe_top_k=k)
    model = GPT(cfg)
    per_expert = 3 * cfg.d_model * cfg.ffn_dim
    dense = GPT(_cfg(n_experts=0))
    extra = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in dense.parameters())
    assert extra == cfg.n_layer * ((cfg.n_experts - 1) * per_expert + cfg.n_experts * cfg.d_model)
    assert math.isfinite(model(torch.randint(0, 64, (1, 4))).sum().item())
