"""A tier for the tests: pages in a dict, standing in for a remote store below the host.

It plugs into a real kvstore with no other module changed: the kvstore's ``tiers``
setting names this module (``RADIXSERVE_KVSTORE_TIERS='["tests.kvstore.dict_tier"]'``),
whose ``TIER`` it builds with `DictTierSettings`, read from ``RADIXSERVE_KVSTORE_DICT_*``.
"""

from __future__ import annotations

import itertools
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

import torch
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.cache.page_proof import PageProof
from radixserve.services.kvstore.tier import TierSpec
from radixserve.services.kvstore.tier_events import TierEvents
from radixserve.transfer import PoolCompat


class DictTierSettings(BaseSettings):
    """The dict tier's settings, from ``RADIXSERVE_KVSTORE_DICT_*``."""

    model_config = SettingsConfigDict(
        env_prefix="RADIXSERVE_KVSTORE_DICT_", frozen=True, extra="forbid"
    )

    capacity_pages: int = Field(64, ge=1, le=1 << 20, description="Pages the dict holds.")


class DictTier:
    """A `LowerTier`: copies of the host pages evicted to it, least recently used first."""

    tier_name, medium, loaded = "dict", "REMOTE", True

    def __init__(self, settings: DictTierSettings, events: TierEvents | None) -> None:
        self.capacity, self.events = settings.capacity_pages, events
        self.pages: OrderedDict[int, tuple[torch.Tensor, PageProof]] = OrderedDict()
        self.held: dict[int, list[int]] = {}  # lease id -> its pages
        self.counters: Counter[str] = Counter()
        self._lease_ids = itertools.count(1)
        self._host_kv: torch.Tensor | None = None

    def open(self, compat: PoolCompat, host_kv: torch.Tensor) -> bool:
        self._host_kv = host_kv
        return True

    def holds(self, page_hash: int) -> bool:
        return page_hash in self.pages

    def proof(self, page_hash: int) -> PageProof | None:
        entry = self.pages.get(page_hash)
        return entry[1] if entry is not None else None

    def hold(self, holder: str, page_hashes: Sequence[int]) -> int:
        lease_id = next(self._lease_ids)
        self.held[lease_id] = list(page_hashes)
        return lease_id

    def release(self, lease_id: int) -> None:
        self.held.pop(lease_id, None)

    def stage(self, page_hash: int, page: torch.Tensor, proof: PageProof | None) -> None:
        if proof is None or page_hash in self.pages:
            return
        self.pages[page_hash] = (page.clone(), proof)  # (L, 2, S, H, D)
        self.counters["dict_stored_pages_total"] += 1
        held = {h for pages in self.held.values() for h in pages}
        over = max(0, len(self.pages) - self.capacity)
        for old in [h for h in self.pages if h not in held][:over]:  # least recent first
            del self.pages[old]

    async def settle(self, page_hash: int, timeout_s: float) -> bool:
        return False  # stored at once

    async def read(self, jobs: Sequence[tuple[int, int]]) -> list[bool]:
        assert self._host_kv is not None
        for page_hash, host_page in jobs:
            self._host_kv[:, :, host_page].copy_(self.pages[page_hash][0])
            self.pages.move_to_end(page_hash)
        return [True] * len(jobs)

    def read_s_per_page(self) -> float | None:
        return None  # unknown: a promotion reads the whole run

    def chunk_pages(self, num_pages: int) -> int:
        return 1

    def promoted(self, good: list[int], bad: list[int], recomputed: int, overlapped: bool) -> None:
        self.counters["dict_hit_pages_total"] += len(good)
        self.counters["dict_overlapped_promotions_total"] += overlapped

    async def flush(self, pages: Iterable[tuple[int, torch.Tensor, PageProof | None]]) -> int:
        return 0  # a remote store keeps what it has; nothing to write at stop

    def stats(self) -> dict[str, int | float]:
        return {"dict_pages_stored": len(self.pages), **self.counters}

    async def stop(self) -> None:
        self.pages.clear()


def _build(name: str, settings: DictTierSettings, events: TierEvents | None) -> DictTier:
    return DictTier(settings, events)


TIER = TierSpec("dict", DictTierSettings, _build)
