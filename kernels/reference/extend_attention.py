"""Attention of a ragged batch of new tokens over their cached prefixes and themselves.

Layout::

    q            (T, H, D)        the new tokens of B sequences, back to back
    cu_seqlens_q (B + 1,) int64   sequence b's new tokens are rows [cu[b], cu[b + 1])
    prefix_lens  (B,) int64       tokens of b cached before them (positions 0..prefix - 1)
    page_table   (B, W) int64     b's pages in order; entries past its length are padding
    k_cache, v_cache (num_pages, page_size, H_kv, D), one layer of the pool

The new tokens' own K/V are already in the pages (`store_kv` runs first). Query i of b, at
position p = prefix_lens[b] + i, sees keys 0..p (causal, bottom-right); with a sliding
`window` w > 0 only keys p - w < j <= p, its last w positions itself included (0: all).
Scores are q k^T * `scale` (None: 1 / sqrt(D)). H is a multiple of H_kv (grouped-query
attention: q head h reads kv head h // (H // H_kv)).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_tokens(cache: torch.Tensor, pages: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens held in `pages` of `cache`, (num_tokens, H_kv, D)."""
    return cache.index_select(0, pages).flatten(0, 1)[:num_tokens]


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    prefix_lens: torch.Tensor,
    page_table: torch.Tensor,
    max_query_len: int,
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """(T, H, D) attention output; `max_query_len` (the longest b's new tokens) sizes a
    kernel's grid and does not change the result."""
    page_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    parts = []
    for b, prefix in enumerate(prefix_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        seq_len = prefix + e - s
        # pages wholly before the first query's window are not read
        first = max(0, prefix - window + 1) // page_size if window else 0
        pages = page_table[b, first : -(-seq_len // page_size)]
        key_start = first * page_size
        k = gather_tokens(k_cache, pages, seq_len - key_start)  # (S, H_kv, D)
        v = gather_tokens(v_cache, pages, seq_len - key_start)
        parts.append(_causal_sdpa(q[s:e], k, v, prefix, key_start, window, scale))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _causal_sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    key_start: int,
    window: int,
    scale: float | None,
) -> torch.Tensor:
    """q (n, H, D) at positions prefix.., over k, v (S, H_kv, D) at positions key_start.."""
    # The batch dimension matters on CPU: 3-D inputs take the unfused math path, ~5x slower.
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    n = q.shape[0]
    if prefix == 0 and (window == 0 or window >= n):  # square causal mask: SDPA's flash path
        out = F.scaled_dot_product_attention(
            q4, k4, v4, is_causal=True, scale=scale, enable_gqa=True
        )
    else:
        key_pos = torch.arange(key_start, prefix + n, device=q.device)
        query_pos = torch.arange(prefix, prefix + n, device=q.device)[:, None]
        mask = key_pos <= query_pos  # (n, S)
        if window:
            mask &= key_pos > query_pos - window
        out = F.scaled_dot_product_attention(
            q4, k4, v4, attn_mask=mask, scale=scale, enable_gqa=True
        )
    return out[0].transpose(0, 1)  # (n, H, D)
