"""One block of attention with its log-sum-exp (tessel.parallel.context.kernel): no processes.

torch's fused CPU kernel against the written-out mathematics, and the online-softmax merge: blocks of
keys merged by their log-sum-exp, and each block's backward given the merged output, give exactly the
attention over all keys and its gradients (what ring attention relies on). fp64 where the kernel takes
it, so the comparisons are tight."""

import torch
from torch.testing import assert_close

from tessel.parallel.context.kernel import (Scores, attend, attend_backward, fold_kv, masked_block,
                                            masked_block_backward, math_block, math_block_backward, merge, repeat_kv)


def _qkv(tq: int, tk: int, dtype=torch.float64):
    torch.manual_seed(0)
    return torch.randn(2, 4, tq, 8, dtype=dtype), torch.randn(2, 4, tk, 8, dtype=dtype), \
        torch.randn(2, 4, tk, 8, dtype=dtype)


def test_the_fused_kernel_matches_the_mathematics():
    for causal, (tq, tk) in ((True, (6, 6)), (False, (3, 7))):
        q, k, v = _qkv(tq, tk, torch.float32)
        out, lse = attend(q, k, v, causal, 0.3)
        ref_out, ref_lse = math_block(q, k, v, causal, 0.3)
        assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        assert_close(lse, ref_lse, rtol=1e-5, atol=1e-6)
        dout = torch.randn_like(out)
        for got, want in zip(attend_backward(dout, q, k, v, out, lse, causal, 0.3),
                             math_block_backward(dout, q, k, v, ref_out, ref_lse, causal, 0.3)):
            assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_blocks_merged_by_log_sum_exp_are_the_attention_over_all_keys():
    q, k, v = _qkv(5, 9)
    parts = [(k[:, :, :4], v[:, :, :4]), (k[:, :, 4:], v[:, :, 4:])]
    acc = None
    for bk, bv in parts:
        acc = merge(acc, math_block(q, bk, bv, False, 0.25))
    whole = math_block(q, k, v, False, 0.25)
    assert_close(acc[0], whole[0].float(), rtol=1e-6, atol=1e-7)
    assert_close(acc[1], whole[1])
    # each block's backward, given the merged output and log-sum-exp, is its share of the whole backward
    dout = torch.randn_like(q)
    grads = [math_block_backward(dout, q, bk, bv, whole[0], whole[1], False, 0.25) for bk, bv in parts]
    dq, dk, dv = math_block_backward(dout, q, k, v, whole[0], whole[1], False, 0.25)
    assert_close(grads[0][0] + grads[1][0], dq)
    assert_close(torch.cat((grads[0][1], grads[1][1]), 2), dk)
    assert_close(torch.cat((grads[0][2], grads[1][2]), 2), dv)


def test_grouped_query_heads_are_repeated_and_their_gradients_summed():
    kv = torch.randn(2, 2, 3, 4, requires_grad=True)
    repeated = repeat_kv(kv, 6)  # each kv head serves 3 query heads
    grad = torch.randn_like(repeated)
    repeated.backward(grad)
    assert_close(fold_kv(grad, 2), kv.grad)


def test_masked_blocks_merged_are_windowed_soft_capped_attention():
    """A sliding window and soft-capped scores (kernel.Scores), as transformers' eager attention computes them
    (Gemma 2's: cap * tanh(s / cap), then the mask), from blocks of keys at their global positions: the merged
    output and each block's backward equal autograd through the whole computation. Window 3 hides the whole
    first block from the last queries (an empty block: out 0, log-sum-exp -inf). The blocks compute in fp32
    (as math_block does), the reference in fp64: within fp32's rounding (~1e-7 relative)."""
    q, k, v = (t.requires_grad_() for t in _qkv(6, 6))
    scores, at = Scores(window=3, softcap=0.5), torch.arange(6)
    s = torch.tanh(q @ k.transpose(-2, -1) * 0.3 / 0.5) * 0.5
    want = torch.softmax(s.masked_fill(~scores.allowed(at, at), float("-inf")), -1) @ v
    dout = torch.randn_like(want)
    want.backward(dout)
    halves = (slice(0, 3), slice(3, 6))
    acc = None
    for keys in halves:
        acc = merge(acc, masked_block(q, k[:, :, keys], v[:, :, keys], scores.allowed(at, at[keys]), 0.3, 0.5))
    tol = dict(rtol=1e-5, atol=1e-6)
    assert_close(acc[0], want.detach().float(), **tol)
    grads = [masked_block_backward(dout, q, k[:, :, keys], v[:, :, keys], acc[0], acc[1],
                                   scores.allowed(at, at[keys]), 0.3, 0.5) for keys in halves]
    assert_close(grads[0][0] + grads[1][0], q.grad, **tol)
    assert_close(torch.cat((grads[0][1], grads[1][1]), 2), k.grad, **tol)
    assert_close(torch.cat((grads[0][2], grads[1][2]), 2), v.grad, **tol)
