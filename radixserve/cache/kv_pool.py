"""The preallocated KV page pool: K and V of every layer in one contiguous tensor.

Layout (row-major, one tensor, so a transfer backend registers it once)::

    kv[layer, kind, page, slot, kv_head, head_dim]      kind 0 = K, 1 = V
       └─ shape (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim)

    region r = layer * 2 + kind  (a contiguous (num_pages, page_size, H_kv, D) block)
    page p of region r starts at element offset (r * num_pages + p) * page_elems
    page_elems = page_size * num_kv_heads * head_dim

So one page of one layer's K (or V) is a contiguous run of `PoolCompat.region_bytes` bytes, and a
descriptor id `r * num_pages + p` names it — the form NIXL descriptor lists want.
The pool owns storage only; `PageAllocator` decides which page ids are in use.
"""

from __future__ import annotations

import torch

from radixserve.errors import CapacityError
from radixserve.model.config import ModelConfig
from radixserve.model.tp import TPShard


class KVPool:
    """Storage for `num_pages` pages of `page_size` tokens, every layer, K and V."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.page_size = page_size
        self.num_pages = num_pages
        # (L, 2, P, page_size, H_kv, D); zeroed so unused slots never hold NaNs.
        self.kv = torch.zeros(
            (num_layers, 2, num_pages, page_size, num_kv_heads, head_dim),
            dtype=dtype,
            device=device,
        )
        # what the model's forward reads and writes: per layer, views of `kv`
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [
            (self.kv[i, 0], self.kv[i, 1]) for i in range(num_layers)
        ]

    @classmethod
    def from_config(
        cls,
        config: ModelConfig,
        page_size: int,
        num_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        tp: TPShard | None = None,
    ) -> KVPool:
        """A pool shaped for `config`'s layers and KV heads (those of tensor-parallel
        rank ``tp``: `TPShard.kv_heads`)."""
        return cls(
            config.num_layers, (tp or TPShard()).kv_heads(config), config.head_dim,
            page_size, num_pages, dtype, device,
        )  # fmt: skip

    @staticmethod
    def page_bytes_all_layers(
        config: ModelConfig, page_size: int, dtype: torch.dtype, tp: TPShard | None = None
    ) -> int:
        """Bytes one page occupies across all layers, K and V (on rank ``tp``: its
        heads' share; None: the whole page, as the tiers below the device hold it)."""
        heads = (tp or TPShard()).kv_heads(config)
        layer_bytes = page_size * heads * config.head_dim * dtype.itemsize
        return 2 * config.num_layers * layer_bytes

    @classmethod
    def num_pages_for_budget(
        cls,
        config: ModelConfig,
        page_size: int,
        dtype: torch.dtype,
        budget_bytes: int,
        tp: TPShard | None = None,
    ) -> int:
        """The most pages that fit in `budget_bytes` (of one rank ``tp``'s pages); at
        least one page must fit."""
        per_page = cls.page_bytes_all_layers(config, page_size, dtype, tp)
        num_pages = budget_bytes // per_page
        if num_pages < 1:
            raise CapacityError(
                f"KV memory budget of {budget_bytes} bytes holds no page "
                f"(one page needs {per_page} bytes); raise kv_cache_memory_gib"
            )
        return int(num_pages)

    @property
    def size_bytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
