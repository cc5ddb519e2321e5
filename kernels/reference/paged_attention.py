"""Paged attention in plain torch: the specification for every faster backend.

Caches are one layer's K or V pages, each (num_pages, page_size, H_kv, D) — see
`radixserve.cache.kv_pool` for the pool layout. A token at absolute position `pos` of a
sequence with page table `pages` lives in page `pages[pos // page_size]`, slot
`pos % page_size`; its flat slot index is `page * page_size + slot`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """Store new keys/values: k, v (T, H_kv, D) go to flat slots `slot_mapping` (T,)."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def gather_pages(cache: torch.Tensor, page_ids: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` tokens of a sequence's pages, (num_tokens, H_kv, D)."""
    pages = cache.index_select(0, page_ids)  # (n_pages, page_size, H_kv, D)
    return pages.flatten(0, 1)[:num_tokens]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_ids: torch.Tensor,
    prefix_len: int,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix and themselves.

    q (n, H, D); k, v (n, H_kv, D) are the new tokens at positions prefix_len..prefix_len+n-1,
    already stored in the caches (`write_kv`); `page_ids` are the sequence's pages through
    position prefix_len + n - 1. Returns (n, H, D).
    """
    n = q.shape[0]
    if prefix_len == 0:
        # No prefix: square causal attention on SDPA's fused (flash) path. The batch
        # dimension matters: 3-D inputs fall back to the unfused math path, ~5x slower on CPU.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # (1, H, n, D)
            k.transpose(0, 1)[None],  # (1, H_kv, n, D)
            v.transpose(0, 1)[None],
            is_causal=True,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    # With a prefix the causal mask is bottom-right aligned: query i (at prefix_len + i)
    # sees keys 0..prefix_len + i.
    # One gather of prefix and new tokens together: the new K/V are already in their pages.
    k_all = gather_pages(k_cache, page_ids, prefix_len + n)  # (S, H_kv, D)
    v_all = gather_pages(v_cache, page_ids, prefix_len + n)
    key_pos = torch.arange(prefix_len + n, device=q.device)
    query_pos = torch.arange(prefix_len, prefix_len + n, device=q.device)
    mask = key_pos[None, :] <= query_pos[:, None]  # (n, prefix_len + n)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # (1, H, n, D)
        k_all.transpose(0, 1)[None],  # (1, H_kv, S, D)
        v_all.transpose(0, 1)[None],
        attn_mask=mask,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    context_lens: torch.Tensor,
) -> torch.Tensor:
    """One new token per sequence attending to its whole context (already in the cache).

    q (B, H, D); page_table (B, max_pages) int64, padded with any valid page id;
    context_lens (B,) tokens each sequence sees, its new token included. Returns (B, H, D).
    """
    batch, max_pages = page_table.shape
    page_size, num_kv_heads, head_dim = k_cache.shape[1:]
    max_len = max_pages * page_size
    k = k_cache.index_select(0, page_table.flatten()).view(batch, max_len, num_kv_heads, head_dim)
    v = v_cache.index_select(0, page_table.flatten()).view(batch, max_len, num_kv_heads, head_dim)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]  # (B, S)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2),  # (B, H, 1, D)
        k.transpose(1, 2),  # (B, H_kv, S, D)
        v.transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        enable_gqa=True,
    )
    return out.squeeze(2)  # (B, H, D)
