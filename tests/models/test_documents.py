"""Packed documents (tessel.models.documents): the masked attention against written-out attention, FlexAttention's
mask against the boolean one, the reference GPT reading each document as if it were alone, a compiled block
taking the mask as an input, and the layouts refused. Parallel layouts carry it: tp2_sp_documents in
tests/parallel/tensor/test_tensor_parallel.py, dp2_zero3_documents in tests/parallel/test_hybrid.py, and
documents_selective in tests/parallel/test_compile.py (compiled against eager, nothing compiled after step 1)."""

from __future__ import annotations

import math

import pytest
import torch
from torch._dynamo.utils import counters

from tessel.config import ConfigError
from tessel.models import documents as docs
from tessel.models import window as win
from tessel.models.gpt import GPT
from tessel.planner.layout import Layout
from tessel.commands.planning import recipe_allows
from tests.helpers import tiny_config

SEP = 7  # the separator of these tests; other tokens are drawn from the rest of a 32-id vocabulary
T = 12
# where the separators stand in a row of T tokens: none, one in the middle, several, at the last position
# (nothing after it: the row is one document), and at position 0 (a document of the separator alone)
LAYOUTS = {"none": [], "middle": [5], "several": [2, 6, 7, 10], "last": [T - 1], "first": [0]}


def _ids(*layouts: list[int], length: int = T, seed: int = 0) -> torch.Tensor:
    """(B, length) token ids, none of them SEP except at the given positions of each row."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 31, (len(layouts), length), generator=gen)
    ids = ids + (ids >= SEP).long()  # 0..31 without SEP
    for row, at in enumerate(layouts):
        ids[row, at] = SEP
    return ids


def _written_out(q, k, v, ids: torch.Tensor, window: int | None) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v with a score kept only where key j is not after query i, in i's document
    (a separator closes its own) and, with a window, fewer than `window` back: loop by loop."""
    B, T_ = ids.shape
    doc = [[sum(int(ids[b, t]) == SEP for t in range(i)) for i in range(T_)] for b in range(B)]
    allowed = torch.tensor([[[j <= i and doc[b][j] == doc[b][i] and (window is None or i - j < window)
                              for j in range(T_)] for i in range(T_)] for b in range(B)])
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.size(-1))
    return torch.softmax(scores.masked_fill(~allowed[:, None], float("-inf")), dim=-1) @ v


def _qkv(B: int, length: int = T, requires_grad: bool = True):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(B, 3, length, 8, generator=gen).requires_grad_(requires_grad) for _ in range(3)]


@pytest.mark.parametrize("window", [None, 4])
def test_masked_attention_is_written_out_attention_within_each_document(window):
    ids = _ids(*LAYOUTS.values())  # one row per layout, each row its own documents
    q, k, v = _qkv(len(LAYOUTS))
    out = docs.masked_attention(q, k, v, docs.document_mask(ids, SEP, window))
    ref = _written_out(q, k, v, ids, window)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(2))
    # fp32, the same sums in another order (SDPA's kernel against softmax and matmul): ~1e-7 relative per
    # element, far below what one key let across a boundary would move (an O(1) softmax weight)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    # a query alone in its document (the separator at 7 after one at 6) has a query gradient of exactly 0,
    # (grad . v - grad . out) k with out = v; SDPA's out is v to rounding, so it gets that rounding of O(1)
    # numbers (measured 1.2e-6): hence atol 1e-5, still far below an O(1) leak across a boundary
    for a, b in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q, k, v), grad)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert docs.document_ids(ids, SEP)[2].tolist() == [0, 0, 0, 1, 1, 1, 1, 2, 3, 3, 3, 4]  # "several"


@pytest.mark.skipif(win.flex_attention is None, reason="this torch has no FlexAttention (before 2.5)")
def test_flex_attention_takes_the_same_documents(monkeypatch):
    # the GPU's path, forward only: torch has no FlexAttention backward on the CPU (unfused here, and slow).
    # document_mask as it runs on a GPU (uses_flex), then FlexAttention uncompiled, against the boolean mask
    from torch.nn.attention.flex_attention import BlockMask  # deferred: a torch before 2.5 lacks it
    monkeypatch.setattr(docs, "uses_flex", lambda t: True)
    ids = _ids([5, 20], [], [0, 9, 31], length=32)  # 32 tokens: several of FlexAttention's blocks
    q, k, v = _qkv(3, length=32, requires_grad=False)
    for window in (None, 6):
        block_mask = docs.document_mask(ids, SEP, window)
        assert isinstance(block_mask, BlockMask)
        flex = win.flex_attention(q, k, v, block_mask=block_mask)
        monkeypatch.setattr(docs, "uses_flex", lambda t: False)
        dense = docs.masked_attention(q, k, v, docs.document_mask(ids, SEP, window))
        monkeypatch.setattr(docs, "uses_flex", lambda t: True)
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)  # as above


def _gpt(*overrides: str) -> GPT:
    torch.manual_seed(0)
    return GPT(tiny_config("model.vocab_size=32", *overrides).model)


@pytest.mark.parametrize("window", [None, 4])
def test_each_document_reads_as_if_it_were_alone(window):
    extra = [] if window is None else [f"model.sliding_window={window}"]
    packed, plain = _gpt(f"model.document_separator={SEP}", *extra), _gpt(*extra)
    row = _ids([6, 15], length=20)  # documents [0, 6], [7, 15], [16, 19]
    got, unmasked = packed(row), plain(row)
    for start, end in ((0, 7), (7, 16), (16, 20)):
        alone = plain(row[:, start:end])  # no separator inside: plain causal attention, positions from 0
        # rotary scores depend on position differences only (tessel.models.documents), so the document at an
        # offset differs from itself alone by the rounding of the tables' angles: ~1e-7 relative, against
        # the O(1e-2) that attention to the previous document moves the logits by (asserted below)
        torch.testing.assert_close(got[:, start:end], alone, rtol=1e-5, atol=1e-5)
    assert (got[:, 7:] - unmasked[:, 7:]).abs().amax() > 1e-3  # without the mask, documents see each other
    torch.testing.assert_close(got[:, :7], unmasked[:, :7], rtol=1e-5, atol=1e-5)  # the first sees nothing else
    no_separator = _ids([], [], length=20, seed=2)
    # no separator in the batch: the same causal attention (the boolean mask's SDPA against is_causal's)
    torch.testing.assert_close(packed(no_separator), plain(no_separator), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(win.flex_attention is None, reason="this torch has no FlexAttention (before 2.5)")
def test_a_compiled_block_takes_the_block_mask_as_an_input(monkeypatch):
    """The GPU's mask through a compiled block (train.compile = "blocks"): BlockMask is a pytree whose mask
    function's tensors (the document ids) are graph inputs, so a batch with other documents reuses the graph.
    aot_eager, forward only (no FlexAttention backward on the CPU)."""
    monkeypatch.setattr(docs, "uses_flex", lambda t: True)
    model = _gpt(f"model.document_separator={SEP}")
    block = model.layers[0]
    compiled = torch.compile(block.forward, backend="aot_eager", dynamic=False)
    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(2, 32, 32)
    for layouts in (([5, 20], [0]), ([], [3, 4, 31]), ([16], [8, 24])):
        ids = _ids(*layouts, length=32)
        block_mask = docs.document_mask(ids, SEP)
        with torch.no_grad():
            got = compiled(x, model.rope_cos, model.rope_sin, block_mask)
            monkeypatch.setattr(docs, "uses_flex", lambda t: False)
            want = block(x, model.rope_cos, model.rope_sin, docs.document_mask(ids, SEP))
            monkeypatch.setattr(docs, "uses_flex", lambda t: True)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # FlexAttention against SDPA, as above
    assert counters["frames"]["total"] == 1  # one frame compiled, for the first batch; the others reused it


@pytest.mark.parametrize("overrides, field, words", [
    (["model.document_separator=256"], "model.document_separator", "model.vocab_size is 256"),
    (["model.document_separator=0", "parallel.pp=2"], "model.document_separator", "pipeline"),
    (["model.document_separator=0", "parallel.cp=2"], "model.document_separator", "context parallelism"),
    (["model.document_separator=0", "parallel.tp=4", 'parallel.tp_mode="2d"'], "model.document_separator",
     "tp_mode '2d'"),
    (['model.hf_config="recipes/hf/llama_tiny/config.json"', "model.document_separator=0"],
     "model.document_separator", "transformers"),
])
def test_layouts_that_cannot_carry_documents_are_refused_by_name(overrides, field, words):
    with pytest.raises(ConfigError, match=words) as err:
        tiny_config(*overrides)
    assert err.value.field == field


def test_documents_run_under_1d_tensor_parallelism_and_zero_and_the_planner_offers_only_those():
    tiny_config("model.document_separator=255", "parallel.tp=2", "parallel.sequence_parallel=true")
    tiny_config("model.document_separator=0", "parallel.dp=2", "parallel.zero_stage=3", "model.sliding_window=4")
    allow = recipe_allows(tiny_config("model.document_separator=0"))  # what `tessel plan` may recommend
    assert allow(Layout(dp=2, tp=2, sequence_parallel=True, zero_stage=3))
    assert not any(allow(lay) for lay in (Layout(pp=2), Layout(cp=2), Layout(tp=4, tp_mode="2d")))
    assert recipe_allows(tiny_config())(Layout(pp=2))  # without documents, a pipeline is fine
