"""Which kernel runs attention on a GPU (tessel.observe.attention), with torch's choice mocked: no GPU here.

torch._fused_sdp_choice is what scaled_dot_product_attention calls to pick its kernel; the mock answers as a
GPU would, and scaled_dot_product_attention forced to a fused kernel warns and refuses as torch does on one
(its "No available kernel" after a warning per reason)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.nn.attention import SDPBackend

from tessel.observe import attention
from tests.helpers import tiny_config

CUDA = torch.device("cuda", 0)
REASON = "Flash attention requires the head dimension to be at most 256. Got Query.size(-1): 512."


@pytest.fixture
def gpu(monkeypatch):
    """A GPU as torch would describe it: the probe built on the CPU, the kernel choice and reasons mocked."""
    choice = {"backend": SDPBackend.MATH}
    monkeypatch.setattr(attention, "_said", set())
    monkeypatch.setattr(attention, "probe", lambda heads, seq, dim, dtype, device: torch.empty(1, heads, seq, dim,
                                                                                               dtype=dtype))
    monkeypatch.setattr(torch, "_fused_sdp_choice", lambda *args, **kw: int(choice["backend"]))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")

    def refuse(*args, **kwargs):
        warnings.warn("Flash attention kernel not used because:")
        warnings.warn(REASON)
        raise RuntimeError("No available kernel. Aborting execution.")
    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", refuse)
    return choice


def test_a_math_fallback_is_said_once_with_torchs_reason(gpu):
    cfg = tiny_config("model.d_model=64", "model.n_head=2")
    lines = []
    assert attention.check_attention(cfg, CUDA, lines.append) == "math"
    assert attention.check_attention(cfg, CUDA, lines.append) == "math"  # a second trainer in the process
    assert len(lines) == 1 and lines[0].startswith("[tessel attention] warning: ")
    assert "math kernel for 2 heads of size 32, sequence" in lines[0] and "float32 on NVIDIA H100" in lines[0]
    assert REASON in lines[0] and "not used because" not in lines[0]


def test_a_fused_kernel_and_the_cpu_say_nothing(gpu):
    cfg, lines = tiny_config('train.precision="bf16"'), []
    gpu["backend"] = SDPBackend.FLASH_ATTENTION
    assert attention.check_attention(cfg, CUDA, lines.append) == "flash"
    gpu["backend"] = SDPBackend.MATH
    assert attention.check_attention(cfg, torch.device("cpu"), lines.append) is None
    assert lines == []


def test_the_shape_is_one_ranks_and_ring_attention_is_named(gpu):
    cfg = tiny_config("model.d_model=64", "model.n_head=4", "parallel.tp=2", "parallel.cp=2",
                      'parallel.cp_mode="ulysses"')
    assert attention.attention_shape(cfg) == (1, cfg.train.seq_len, 16)  # 4 heads / tp 2 / ulysses' cp 2
    lines = []
    ring = tiny_config("model.d_model=64", "model.n_head=4", "parallel.cp=2")
    assert attention.check_attention(ring, CUDA, lines.append) == "math"
    assert len(lines) == 1 and "ring attention runs its blocks as written-out math" in lines[0]


def test_a_window_or_packed_documents_train_through_flex_attention(gpu):
    """A masked attention takes FlexAttention's kernel (tessel.models.window, tessel.models.documents), not SDPA:
    nothing to warn about, even where SDPA would fall back to math."""
    lines = []
    for masked in ("model.sliding_window=4", "model.document_separator=0"):
        assert attention.check_attention(tiny_config(masked), CUDA, lines.append) == "flex"
    # a window as long as the sequence masks nothing: SDPA's causal kernel runs, and is checked
    assert attention.check_attention(tiny_config("model.sliding_window=16"), CUDA, lines.append) == "math"
    assert len(lines) == 1
