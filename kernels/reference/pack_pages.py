"""Gather listed pages of every layer into one contiguous buffer, and scatter them back.

Layout: the pool `kv` is (L, 2, num_pages, page_size, H_kv, D) (`radixserve.cache.kv_pool`);
`page_ids` (N,) int64; the packed buffer is (L, 2, N, page_size, H_kv, D), page n of the
buffer being pool page page_ids[n] — the pool's layout restricted to the listed pages, so
one transfer moves one region instead of 2 * L * N page runs.
"""

from __future__ import annotations

import torch


def pack_pages(
    kv: torch.Tensor, page_ids: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """The pages `page_ids` of `kv`, (L, 2, N, page_size, H_kv, D), written into `out` if given."""
    if out is None:
        return kv.index_select(2, page_ids)
    torch.index_select(kv, 2, page_ids, out=out)
    return out


def unpack_pages(kv: torch.Tensor, page_ids: torch.Tensor, packed: torch.Tensor) -> None:
    """Write `packed` (L, 2, N, page_size, H_kv, D) into pool pages `page_ids` of `kv`."""
    kv.index_copy_(2, page_ids, packed)
