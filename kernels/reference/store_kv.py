"""Write a step's new keys and values into their pool slots.

Layout: k_cache, v_cache are one layer's K or V pages, (num_pages, page_size, H_kv, D),
contiguous per token (see `radixserve.cache.kv_pool`). Token t goes to flat slot
`slot_mapping[t] = page * page_size + offset`; a slot of -1 (padding) writes nothing.
"""

from __future__ import annotations

import torch


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v (T, H_kv, D) into slots `slot_mapping` (T,) int64 of k_cache, v_cache."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    if slot_mapping.numel() and int(slot_mapping.min()) < 0:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
