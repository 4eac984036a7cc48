"""Packed documents: causal attention that never crosses a document boundary (model.document_separator).

`tessel data prepare` ends every document with the tokenizer's separator (<|endoftext|>) and concatenates
them, and the sampler cuts training sequences anywhere in that stream, so one sequence holds the end of a
document and the start of an unrelated one. With model.document_separator set, attention is block-causal:
a query sees only the earlier keys of its own document, the separator belonging to the document it ends
(Krell et al. 2021, "Efficient Sequence Packing without Cross-contamination"; Llama 3 masks across
documents the same way, Dubey et al. 2024, section 3.2). With model.sliding_window as well, the window
applies inside the document.

The document of each token is the number of separators before it in its row, a cumulative sum over the
token ids, computed once per forward; so is the mask, which every block's attention takes. Training on a
GPU it is a FlexAttention block mask (tessel.models.window explains the kernel): the blocks of the score
matrix that hold no allowed score are never computed. Elsewhere it is a (B, 1, T, T) boolean mask for
scaled_dot_product_attention, every score computed and the others masked: on the CPU, where torch has no
FlexAttention backward, and without gradients, because sampling's window grows a token at a time and the
compiled FlexAttention would compile once per length (tessel.parallel.compile runs blocks eagerly without
gradients for the same reason). Both come from one mask function, so they cannot disagree.

Rotary positions keep running across documents, as torchtitan's block-causal mask does, rather than
restarting at each. Rotary embeddings (Su et al. 2021, "RoFormer") make a score depend on the positions of
its query and key only through their difference, and every score allowed here has both in one document:
restarting would shift them alike and change no score, only the rounding of the tables' angles. So a
document's logits are those of the document run alone (tests/models/test_documents.py), and no per-token
position table has to reach the blocks. (Trainers with learned absolute positions reset them, because there
the position is part of each token's vector.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessel.models.window import create_block_mask, flex, uses_flex


def document_ids(idx: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) token ids -> (B, T): each token's document within its row, counted from 0; a separator counts
    with the document it ends."""
    ends = (idx == separator).int()
    return ends.cumsum(dim=1) - ends


def within_document(docs: torch.Tensor, window: int | None = None):
    """FlexAttention's mask function: key kv_idx is visible to query q_idx of row `batch` when it is not later,
    in the same document (docs: document_ids) and, with a window, less than `window` positions back."""
    def mask(batch, head, q_idx, kv_idx):
        seen = (q_idx >= kv_idx) & (docs[batch, q_idx] == docs[batch, kv_idx])
        return seen if window is None else seen & (q_idx - kv_idx < window)
    return mask


def document_mask(idx: torch.Tensor, separator: int, window: int | None = None):
    """The mask every block's attention takes for the token ids idx (B, T): a FlexAttention BlockMask where it
    runs with gradients (a GPU), else a (B, 1, T, T) boolean mask, True where a query may attend."""
    B, T = idx.shape
    mask = within_document(document_ids(idx, separator), window)
    if uses_flex(idx) and torch.is_grad_enabled():
        return create_block_mask(mask, B, None, T, T, device=idx.device)  # one mask for every head
    rows = torch.arange(B, device=idx.device)[:, None, None]
    i = torch.arange(T, device=idx.device)
    return mask(rows, None, i[:, None], i[None, :]).unsqueeze(1)  # (B, 1, T, T): every head alike


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    """Softmax attention of q (B, H, T, D) over k, v (B, H, T, D) where `mask` (document_mask) allows; (B, H, T, D).
    Every query sees at least itself, so no row is fully masked (which would give NaN)."""
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return flex(q, k, v, mask)
