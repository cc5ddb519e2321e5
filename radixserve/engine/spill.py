"""The host tier's spill hook: pages the radix cache lets go (evicted, or a prefix used
often enough to write through) are handed to the worker's listener, which copies them
(`copy_out`) into a host buffer of whole pages before their device pages are reused."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.engine.kv_cache_manager import KVCacheManager
from radixserve.engine.model_shard import copy_out
from radixserve.engine.tp_calls import MapSpillBuffer, Spill
from radixserve.engine.tp_group import TPGroup
from radixserve.transfer.shards import KVShard

if TYPE_CHECKING:  # the listener's signature
    from radixserve.cache.radix_cache import SpillCallback


class SpillHook:
    """One engine's spill listener and buffer (engine thread), every rank's heads."""

    def __init__(
        self, kv: KVCacheManager, kv_pool: KVPool, kv_shard: KVShard, tp_group: TPGroup | None
    ) -> None:
        self._kv, self._pool, self._shard, self._tp = kv, kv_pool, kv_shard, tp_group
        self._buffer: torch.Tensor | None = None

    def listen(self, on_spill: SpillCallback | None, write_through_uses: int,
               buffer: torch.Tensor | None, path: str | None) -> None:  # fmt: skip
        """`AsyncEngine.listen_spills`: start (forgetting what was handed over before) or,
        with ``on_spill`` None, stop; ``buffer`` (a file at ``path`` that every rank maps,
        when there are ranks) is where `copy_out` copies pages."""
        cache = self._kv.cache
        if cache is None:
            return
        if on_spill is not None:
            cache.clear_written()
            if buffer is not None:
                self._buffer = buffer
                if self._tp is not None:
                    assert path is not None, "a tensor-parallel worker's spill buffer is a file"
                    dtype = str(buffer.dtype).removeprefix("torch.")
                    self._tp.call(MapSpillBuffer(path, list(buffer.shape), dtype))
        cache.set_spill_listener(on_spill, write_through_uses)

    def copy_out(self, page_ids: list[int], slots: list[int]) -> None:
        """Pages ``page_ids`` into ``slots`` of the spill buffer, each rank its heads."""
        assert self._buffer is not None, "listen with a buffer first"
        copy_out(self._pool, self._shard, page_ids, self._buffer, slots)
        if self._tp is not None:
            self._tp.call(Spill(page_ids, slots))
