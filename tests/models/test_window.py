"""Sliding-window attention (tessel.models.window): the band against written-out attention, FlexAttention's
mask against the band, the reference GPT with a window. Tensor parallelism carries it: tp2_window in
tests/parallel/tensor/test_tensor_parallel.py."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tessel.models import window as win
from tessel.models.gpt import GPT
from tests.helpers import tiny_config


def _written_out(q, k, v, window: int) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with the scores outside the causal window set to -inf, loop by loop."""
    T = q.size(-2)
    allowed = torch.tensor([[0 <= i - j < window for j in range(T)] for i in range(T)])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) @ v


def _qkv(T: int = 12, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(2, 3, T, 8, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


def test_window_attention_is_written_out_attention_within_the_band():
    q, k, v = _qkv()
    out, ref = win.window_attention(q, k, v, 4), _written_out(q, k, v, 4)
    grad = torch.randn_like(out)
    # fp32, the same sums in another order (the fused kernel's online softmax): ~1e-7 relative per element,
    # far below what one score let through the band would move (an O(1) softmax weight)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(win.flex_attention is None, reason="this torch has no FlexAttention (before 2.5)")
def test_flex_attention_takes_the_same_band():
    # the GPU's path, forward only: torch has no FlexAttention backward on the CPU (unfused here, and slow)
    q, k, v = _qkv(T=32, requires_grad=False)
    flex = win.flex_attention(q, k, v, block_mask=win._block_mask(32, 5, q.device))
    torch.testing.assert_close(flex, win.window_attention(q, k, v, 5), rtol=1e-5, atol=1e-6)  # as above


def test_the_gpt_with_a_window_sees_less_only_beyond_it():
    torch.manual_seed(0)
    plain = GPT(tiny_config().model)
    windowed = GPT(tiny_config("model.sliding_window=4").model)
    windowed.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 256, (2, 16))
    a, b = plain(idx), windowed(idx)
    # a token within the first 4 sees the same keys either way (2 layers: its inputs are the same too)
    torch.testing.assert_close(b[:, :4], a[:, :4], rtol=1e-5, atol=1e-5)
    assert (b[:, 8:] - a[:, 8:]).abs().amax() > 1e-3  # beyond it, its attention leaves tokens out


def test_a_hugging_face_model_keeps_its_own_window():
    with pytest.raises(ValueError, match="model.sliding_window is the reference GPT's"):
        tiny_config('model.hf_config="recipes/hf/llama_tiny/config.json"', "model.sliding_window=4")


def test_a_windowed_gpt_does_not_export_as_a_llama():
    from tessel.models.hf.convert import NotConvertible, llama_config
    with pytest.raises(NotConvertible, match="within a window"):
        llama_config(tiny_config("model.sliding_window=4").model)
    assert llama_config(tiny_config("model.sliding_window=32").model)["model_type"] == "llama"  # = max_seq_len
