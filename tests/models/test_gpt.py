"""The reference GPT on one device: shapes, causality, counting, learning."""

import torch
from torch.testing import assert_close

from tessel.config import ModelConfig
from tessel.models.gpt import GPT, count_params, cross_entropy, flops_per_token


def tiny(**kw) -> ModelConfig:
    return ModelConfig(vocab_size=64, n_layer=2, n_head=4, d_model=32, max_seq_len=16, **kw)


def test_logits_shape_and_causality():
    torch.manual_seed(0)
    model = GPT(tiny(n_kv_head=2))
    x = torch.randint(0, 64, (2, 10))
    logits = model(x)
    assert logits.shape == (2, 10, 64)
    x2 = x.clone()
    x2[:, 6:] = (x2[:, 6:] + 1) % 64  # change the future only
    # positions before the change must not see it; exact up to fp32 kernel noise
    assert_close(model(x2)[:, :6], logits[:, :6], rtol=1e-5, atol=1e-6)


def test_param_count_by_hand_and_tied_embeddings():
    cfg = tiny()
    d, f, V, L = 32, cfg.ffn_dim, 64, 2
    per_layer = 4 * d * d + 3 * d * f + 2 * d  # attention, SwiGLU, two norm weights
    expected = V * d + L * per_layer + d + d * V
    assert count_params(GPT(cfg)) == expected
    assert count_params(GPT(tiny(tie_embeddings=True))) == expected - d * V


def test_flops_per_token_by_hand():
    cfg = tiny()
    d, f, V, L, T = 32, cfg.ffn_dim, 64, 2, 16
    matmul = L * (4 * d * d + 3 * d * f) + d * V
    assert flops_per_token(cfg, T) == 6 * matmul + 12 * L * d * T


def test_overfits_one_batch():
    torch.manual_seed(0)
    model = GPT(tiny())
    x = torch.randint(0, 64, (4, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = None
    for _ in range(60):
        loss = cross_entropy(model(x[:, :-1]), x[:, 1:])
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first


def test_generate_appends_tokens():
    model = GPT(tiny())
    out = model.generate(torch.zeros(1, 3, dtype=torch.long), 5, generator=torch.Generator().manual_seed(0))
    assert out.shape == (1, 8) and int(out.max()) < 64
