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


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """Grouped-query attention with an explicit boolean mask (True = may attend).

    q (..., H_kv, G, n, D) with G query heads per KV head; k, v (..., H_kv, S, D);
    mask broadcastable to (..., H_kv, G, n, S). Returns (..., H_kv, G, n, D).
    Scores and softmax are in float32 whatever the input dtype.
    """
    *lead, num_kv_heads, group, n, head_dim = q.shape
    rows = q.reshape(*lead, num_kv_heads, group * n, head_dim)  # fold heads into rows: no broadcast
    scores = torch.matmul(rows, k.transpose(-1, -2)).float() * head_dim**-0.5  # (..., G*n, S)
    scores = scores.view(*lead, num_kv_heads, group, n, -1).masked_fill(~mask, float("-inf"))
    probs = scores.softmax(dim=-1).to(v.dtype).view(*lead, num_kv_heads, group * n, -1)
    return torch.matmul(probs, v).view(*lead, num_kv_heads, group, n, head_dim)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_page_ids: torch.Tensor,
    prefix_len: int,
    block_queries: int = 256,
) -> torch.Tensor:
    """Causal attention of one sequence's new tokens over its cached prefix and themselves.

    q (n, H, D); k, v (n, H_kv, D) are the new tokens at positions prefix_len..prefix_len+n-1;
    the prefix's keys and values are read from the pages in `prefix_page_ids`.
    Returns (n, H, D).
    """
    n, num_heads, head_dim = q.shape
    if prefix_len == 0:
        # No prefix: square causal attention, SDPA's fused (flash) path.
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True
        )
        return out.transpose(0, 1)
    # With a prefix the causal mask is bottom-right aligned, which SDPA only serves through
    # its slow masked path on CPU; explicit matmuls in query blocks are several times faster
    # and bound the score matrix to (H, block_queries, S).
    num_kv_heads = k.shape[1]
    group = num_heads // num_kv_heads
    k_all = torch.cat([gather_pages(k_cache, prefix_page_ids, prefix_len), k]).transpose(0, 1)
    v_all = torch.cat([gather_pages(v_cache, prefix_page_ids, prefix_len), v]).transpose(0, 1)
    qg = q.view(n, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)  # (H_kv, G, n, D)
    key_pos = torch.arange(prefix_len + n, device=q.device)
    out = torch.empty_like(qg)
    for lo in range(0, n, block_queries):
        hi = min(n, lo + block_queries)
        query_pos = torch.arange(prefix_len + lo, prefix_len + hi, device=q.device)
        mask = key_pos[None, :] <= query_pos[:, None]  # (hi - lo, S)
        out[:, :, lo:hi] = masked_attention(qg[:, :, lo:hi], k_all, v_all, mask)
    return out.permute(2, 0, 1, 3).reshape(n, num_heads, head_dim)


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
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    max_len = page_table.shape[1] * page_size
    group = num_heads // num_kv_heads
    k = k_cache.index_select(0, page_table.flatten()).view(batch, max_len, num_kv_heads, head_dim)
    v = v_cache.index_select(0, page_table.flatten()).view(batch, max_len, num_kv_heads, head_dim)
    valid = torch.arange(max_len, device=q.device)[None, :] < context_lens[:, None]  # (B, S)
    out = masked_attention(
        q.view(batch, num_kv_heads, group, 1, head_dim),
        k.transpose(1, 2),  # (B, H_kv, S, D)
        v.transpose(1, 2),
        valid[:, None, None, None, :],
    )  # (B, H_kv, G, 1, D)
    return out.reshape(batch, num_heads, head_dim)
