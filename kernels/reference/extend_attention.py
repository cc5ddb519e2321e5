"""Attention of a ragged batch of new tokens over their cached prefixes and themselves.

Layout::

    q            (T, H, D)        the new tokens of B sequences, back to back
    cu_seqlens_q (B + 1,) int64   sequence b's new tokens are rows [cu[b], cu[b + 1])
    prefix_lens  (B,) int64       tokens of b cached before them (positions 0..prefix - 1)
    page_table   (B, W) int64     b's pages in order; entries past its length are padding
    k_cache, v_cache (num_pages, page_size, H_kv, D), one layer of the pool

The new tokens' own K/V are already in the pages (`store_kv` runs first). Query i of b, at
position prefix_lens[b] + i, sees keys 0..prefix_lens[b] + i (causal, bottom-right). H is
a multiple of H_kv (grouped-query attention: q head h reads kv head h // (H // H_kv)).
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
) -> torch.Tensor:
    """(T, H, D) attention output; `max_query_len` (the longest b's new tokens) sizes a
    kernel's grid and does not change the result."""
    page_size = k_cache.shape[1]
    starts = cu_seqlens_q.tolist()
    parts = []
    for b, prefix in enumerate(prefix_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        seq_len = prefix + e - s
        pages = page_table[b, : -(-seq_len // page_size)]
        k = gather_tokens(k_cache, pages, seq_len)  # (S, H_kv, D)
        v = gather_tokens(v_cache, pages, seq_len)
        parts.append(_causal_sdpa(q[s:e], k, v, prefix))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, prefix: int) -> torch.Tensor:
    # The batch dimension matters on CPU: 3-D inputs take the unfused math path, ~5x slower.
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    if prefix == 0:  # square causal mask: SDPA's fused (flash) path
        out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True, enable_gqa=True)
    else:
        n = q.shape[0]
        key_pos = torch.arange(prefix + n, device=q.device)
        query_pos = torch.arange(prefix, prefix + n, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # (n, prefix + n)
        out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, enable_gqa=True)
    return out[0].transpose(0, 1)  # (n, H, D)
