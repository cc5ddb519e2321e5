"""One new token per sequence attending to its whole context in the paged pool.

Layout::

    q            (B, H, D)        one query per sequence
    page_table   (B, W) int64     b's pages in order; entries past its length are padding
    seq_lens     (B,) int64       tokens b sees, its new one included (already stored);
                                  0 marks a padding row, whose output is 0
    k_cache, v_cache (num_pages, page_size, H_kv, D), one layer of the pool

The query sits at position seq_lens[b] - 1 and sees tokens 0..seq_lens[b] - 1; with a
sliding `window` w > 0 only its last w, seq_lens[b] - w..seq_lens[b] - 1 (0: all). Scores
are q k^T * `scale` (None: 1 / sqrt(D)). Grouped-query attention as in `extend_attention`.
`num_splits` tells a split-K kernel how many pieces to cut each context into; it does not
change the result.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    num_splits: int | None = None,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """(B, H, D): softmax(q k^T * scale) v over the tokens each b's query sees."""
    batch, width = page_table.shape
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = width * page_size
    pos = torch.arange(max_len, device=q.device)[None, :]
    valid = pos < seq_lens[:, None]  # (B, S)
    if window:
        valid &= pos >= seq_lens[:, None] - window
    # Gather token by token, reading only tokens the query sees: a masked position re-reads
    # the sequence's token 0, or in a window its last (whatever lies elsewhere, even NaN,
    # stays unread).
    pos = torch.where(valid, pos, (seq_lens[:, None] - 1).clamp(min=0) if window else 0)
    slots = (page_table.gather(1, pos // page_size) * page_size + pos % page_size).flatten()
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)  # (B * S, H_kv, D)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, slots)
    # The q heads of one kv head act as that head's query rows: no K/V copy per q head.
    group = q.shape[1] // num_kv_heads
    out = F.scaled_dot_product_attention(
        q.reshape(batch, num_kv_heads, group, head_dim),  # (B, H_kv, G, D)
        k.view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2),  # (B, H_kv, S, D)
        v.view(batch, max_len, num_kv_heads, head_dim).transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
    ).reshape(batch, num_kv_heads * group, head_dim)  # (B, H, D)
    return torch.where((seq_lens > 0)[:, None, None], out, 0.0)
