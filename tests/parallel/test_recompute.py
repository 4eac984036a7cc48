"""Activation recomputation changes memory, never the numbers: selective (the attention core) and full
recompute give the same loss and gradients as none, in one process and under tp2 (one spawn)."""

import pytest
import torch
from torch.testing import assert_close

from tessel.config import ConfigError, ModelConfig, build_config
from tessel.models.gpt import GPT, Attention, cross_entropy
from tessel.parallel.recompute import _Recomputed, recompute_attention_cores, recompute_blocks
from tessel.spawn import spawn
from tests.helpers import build_trainer, tiny_config

# the recomputed forward runs the same kernels on the same inputs as the first one, in the same order
# relative to the backward that consumes it, so on CPU the results are bitwise equal: tolerance 0
EXACT = dict(rtol=0, atol=0)


def _loss_and_grads(model: GPT, idx: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = cross_entropy(model(idx), idx)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kv_heads", [4, 2])  # plain and grouped-query attention (the kv repeat is in the core)
def test_selective_and_full_recompute_match_none_in_one_process(kv_heads):
    cfg = ModelConfig(vocab_size=64, n_layer=2, n_head=4, n_kv_head=kv_heads, d_model=32, max_seq_len=16)
    torch.manual_seed(0)
    ref = GPT(cfg)
    idx = torch.randint(0, 64, (2, 16))
    want_loss, want = _loss_and_grads(ref, idx)
    for apply in (lambda m: recompute_attention_cores(m.modules()), lambda m: recompute_blocks(m.layers)):
        model = GPT(cfg)
        model.load_state_dict(ref.state_dict())
        apply(model)
        assert [n for n, _ in model.named_parameters()] == list(want)  # names unchanged
        loss, grads = _loss_and_grads(model, idx)
        assert_close(loss, want_loss, **EXACT)
        for name, g in grads.items():
            assert_close(g, want[name], **EXACT, msg=name)


def test_selective_wraps_only_the_attention_core():
    model = GPT(ModelConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, max_seq_len=16))
    recompute_attention_cores(model.modules())
    recompute_attention_cores(model.modules())  # idempotent: one checkpoint per core
    cores = [m for m in model.modules() if isinstance(m, Attention)]
    assert len(cores) == 2 and all(isinstance(a.core, _Recomputed) and not isinstance(a.core.inner, _Recomputed)
                                   for a in cores)
    assert not any(isinstance(b.forward, _Recomputed) for b in model.layers)


def test_recompute_modes_are_validated():
    assert build_config({"parallel": {"recompute": True}}).parallel.recompute == "full"
    assert build_config({"parallel": {"recompute": False}}).parallel.recompute == "none"
    assert build_config({}, ['parallel.recompute="selective"']).parallel.recompute == "selective"
    with pytest.raises(ConfigError) as err:
        build_config({"parallel": {"recompute": "attention"}})
    assert err.value.field == "parallel.recompute"


def _tp2_step(modes: list[str]) -> dict:
    """One forward + backward of the same batch under tp2 for each recompute mode, from the same weights."""
    out = {}
    for mode in modes:
        cfg = tiny_config("parallel.tp=2", f'parallel.recompute="{mode}"')
        _, model, runner, _ = build_trainer(cfg, init_seed=7)
        idx = torch.randint(0, cfg.model.vocab_size, (4, cfg.train.seq_len), generator=torch.Generator().manual_seed(3))
        loss = runner.forward_backward(idx, idx)
        out[mode] = {"loss": float(loss), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}
    return out


def test_selective_recompute_matches_none_under_tp2():
    for rank in spawn(_tp2_step, 2, ["none", "selective", "full"]):
        for mode in ("selective", "full"):
            assert rank[mode]["loss"] == rank["none"]["loss"]
            for name, g in rank[mode]["grads"].items():
                assert_close(g, rank["none"]["grads"][name], **EXACT, msg=f"{mode} {name}")
