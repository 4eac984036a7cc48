"""Ring attention (Liu, Zaharia and Abbeel 2023, "Ring Attention with Blockwise Transformers for
Near-Infinite Context"): each cp rank keeps its queries and passes its key/value block around the ring,
computing attention against one block while the next one travels.

With the load-balanced layout (tessel.parallel.context.layout) rank r holds
chunks r and 2cp-1-r of every sequence, for its queries and for the key/value
block it starts with. At ring step i it holds the block of rank s = r - i:

- s = r: its own chunks, causal (positions rise with the local index);
- s < r: both query chunks lie after chunk s and before chunk 2cp-1-s, so
  every query sees the block's head chunk whole and none of its tail chunk;
- s > r: the query head chunk r precedes both of the block's chunks (sees
  nothing), the query tail chunk 2cp-1-r follows both (sees them whole).

So every step after the first costs exactly half a block on every rank: the
causal triangle's work is the same on all of them (Brandon et al. 2023,
"Striped Attention", on why this balance matters). Partial results
merge by their log-sum-exp (tessel.parallel.context.kernel.merge).

Backward passes the key/value blocks around again; the gradient of a block's
keys and values travels with it, each rank adding its queries' share, and
after cp steps one more hop brings every block's gradient home.

A sliding window or soft-capped scores (kernel.Scores) break the three cases' shortcut (a window hides part
of a block's head chunk, the cap does not fit the fused kernel), so then every step computes its block
whole under the mask of its queries' and keys' global positions (kernel.masked_block), and a block the
window hides entirely from this rank's queries is passed on without any work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from tessel.parallel.context import layout
from tessel.parallel.context.kernel import (PLAIN, Scores, attend, attend_backward, fold_kv, masked_block,
                                            masked_block_backward, merge, repeat_kv)


@dataclass(frozen=True)
class Ring:
    """The cp group as a ring of global ranks: index i sends to i+1 and receives from i-1."""
    group: object  # the cp process group
    ranks: tuple[int, ...]  # global ranks by cp index
    index: int  # this rank's cp index

    @property
    def size(self) -> int:
        return len(self.ranks)

    def positions(self, index: int, local_len: int, device: torch.device) -> torch.Tensor:
        """The global sequence positions of the `local_len` tokens cp rank `index` holds."""
        return torch.tensor(layout.positions(local_len * self.size, self.size, index), device=device)

    def shift(self, *tensors: torch.Tensor) -> tuple[list[torch.Tensor], list]:
        """Start sending each tensor to the next rank and receiving its like from the previous one
        (batch_isend_irecv, non-blocking); returns the receive buffers and the requests to wait on."""
        nxt, prev = self.ranks[(self.index + 1) % self.size], self.ranks[(self.index - 1) % self.size]
        recvs = [torch.empty_like(t) for t in tensors]
        ops = [op for t, r in zip(tensors, recvs, strict=True)
               for op in (dist.P2POp(dist.isend, t, nxt, self.group), dist.P2POp(dist.irecv, r, prev, self.group))]
        return recvs, dist.batch_isend_irecv(ops)


def _wait(requests: list) -> None:
    for req in requests:
        req.wait()


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence's keys and values, blocks passed
    around the cp ring (Liu et al. 2023), the next transfer overlapped with the current block's compute.

    q (B, H, 2c, D); k (B, Hkv, 2c, D), v (B, Hkv, 2c, Dv): this rank's head and tail chunks of c tokens. Keys
    and values travel with their Hkv heads (grouped-query attention repeats them per block, not on the wire),
    side by side in one message (values may be narrower than keys: DeepSeek's latent attention)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float,
                scores: Scores = PLAIN) -> torch.Tensor:
        heads, c, dk = q.size(1), q.size(2) // 2, k.size(-1)
        kv = torch.cat((k, v), -1).contiguous()  # one message a step
        out = lse = None
        for step in range(ring.size):
            source = (ring.index - step) % ring.size
            recvs, pending = ring.shift(kv) if step + 1 < ring.size else ([kv], [])
            bk, bv = _unpack(kv, dk, heads)
            if not scores.plain:
                allowed = _allowed(ring, source, q, scores)
                if allowed.any():  # the own block always: every query sees itself
                    block = masked_block(q, bk, bv, allowed, scale, scores.softcap)
                    out, lse = merge(None if out is None else (out, lse), block)
            elif source == ring.index:
                out, lse = merge(None, attend(q, bk, bv, True, scale))
            elif source < ring.index:  # every query sees the block's head chunk
                out, lse = merge((out, lse), attend(q, bk[:, :, :c], bv[:, :, :c], False, scale))
            else:  # only the tail queries see the block, whole
                tail = merge((out[:, :, c:], lse[:, :, c:]), attend(q[:, :, c:], bk, bv, False, scale))
                out, lse = torch.cat((out[:, :, :c], tail[0]), 2), torch.cat((lse[:, :, :c], tail[1]), 2)
            _wait(pending)
            kv = recvs[0]
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.scores = ring, scale, scores
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        ring, scale, scores = ctx.ring, ctx.scale, ctx.scores
        heads, kv_heads, c, dk = q.size(1), k.size(1), q.size(2) // 2, k.size(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.cat((k, v), -1).contiguous()
        carried = None  # the gradient of the block held at the previous step, summed so far
        for step in range(ring.size):
            source = (ring.index - step) % ring.size
            outgoing = ([kv] if step + 1 < ring.size else []) + ([carried] if carried is not None else [])
            recvs, pending = ring.shift(*outgoing) if outgoing else ([], [])
            if scores.plain:
                dkv = _block_grads(dq, dout, q, kv, out, lse, source, ring.index, dk, kv_heads, c, scale)
            else:
                dkv = _masked_block_grads(dq, dout, q, kv, out, lse, _allowed(ring, source, q, scores), dk,
                                          kv_heads, scale, scores)
            _wait(pending)
            if carried is not None:
                dkv += recvs[-1]  # the block's gradient from the ranks that held it before
            carried = dkv
            if step + 1 < ring.size:
                kv = recvs[0]
        if ring.size > 1:  # the block held last is rank index+1's: one more hop home
            recvs, pending = ring.shift(carried)
            _wait(pending)
            carried = recvs[0]
        return dq.to(q.dtype), carried[..., :dk].to(k.dtype), carried[..., dk:].to(v.dtype), None, None, None


def _unpack(kv: torch.Tensor, dk: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A travelling block (B, Hkv, T, Dk + Dv) -> its keys and values, repeated to the query heads."""
    return repeat_kv(kv[..., :dk].contiguous(), heads), repeat_kv(kv[..., dk:].contiguous(), heads)


def _allowed(ring: Ring, source: int, q: torch.Tensor, scores: Scores) -> torch.Tensor:
    """(T, T): which keys of cp rank `source`'s block this rank's queries see, from their global positions."""
    local = q.size(2)
    return scores.allowed(ring.positions(ring.index, local, q.device), ring.positions(source, local, q.device))


def _masked_block_grads(dq: torch.Tensor, dout, q, kv, out, lse, allowed: torch.Tensor, dk: int, kv_heads: int,
                        scale: float, scores: Scores) -> torch.Tensor:
    """_block_grads for a block under a mask (kernel.Scores): the whole block, or nothing where none is seen."""
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if allowed.any():
        gq, gk, gv = masked_block_backward(dout, q, *_unpack(kv, dk, q.size(1)), out, lse, allowed, scale,
                                           scores.softcap)
        dq += gq
        dkv[..., :dk], dkv[..., dk:] = fold_kv(gk, kv_heads), fold_kv(gv, kv_heads)
    return dkv


def _block_grads(dq: torch.Tensor, dout, q, kv, out, lse, source: int, index: int, dk: int, kv_heads: int,
                 c: int, scale: float) -> torch.Tensor:
    """Adds this block's share to dq (in place); returns the block's (B, Hkv, 2c, Dk + Dv) fp32 key/value
    gradient. The same three cases as the forward (see the module's docstring)."""
    bk, bv = _unpack(kv, dk, q.size(1))
    dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
    if source == index:
        gq, gk, gv = attend_backward(dout, q, bk, bv, out, lse, True, scale)
        dq += gq
        dkv[..., :dk], dkv[..., dk:] = fold_kv(gk, kv_heads), fold_kv(gv, kv_heads)
    elif source < index:
        gq, gk, gv = attend_backward(dout, q, bk[:, :, :c], bv[:, :, :c], out, lse, False, scale)
        dq += gq
        dkv[:, :, :c, :dk], dkv[:, :, :c, dk:] = fold_kv(gk, kv_heads), fold_kv(gv, kv_heads)
    else:
        gq, gk, gv = attend_backward(dout[:, :, c:], q[:, :, c:], bk, bv, out[:, :, c:], lse[:, :, c:], False, scale)
        dq[:, :, c:] += gq
        dkv[..., :dk], dkv[..., dk:] = fold_kv(gk, kv_heads), fold_kv(gv, kv_heads)
    return dkv


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring, scale: float,
                   scores: Scores = PLAIN) -> torch.Tensor:
    return RingAttention.apply(q, k, v, ring, scale, scores)
