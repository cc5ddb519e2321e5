"""The kvstore's tiers: the interface each keeps, and the registry that builds them.

The kvstore holds its tiers in a list, fastest first (`KVStoreService.tiers`)::

    workers' device pools
      │ SpillOffer: the host tier reads        ▲ HostLease: workers read the host pages
      ▼   the worker's spill buffer            │   they were leased
    tiers[0]  host memory (`HostPool`): the only tier workers speak to
      │ stage: a copy of each page it evicts,  ▲ promote (`Promotion`): on a lookup, the
      ▼   to every tier below                  │   run's pages read into host pages
    tiers[1:] the ``tiers`` setting's, in order: ``disk`` (`DiskPool`), a plug-in, ...

A tier holds whole pages (every layer, K and V, every head: the host pool's layout, so
no tier depends on the workers' tensor parallelism), named by chained page hash, each
with its proof (`PageProof`), and owns its storage, its index (and LRU) and its
threads. Each tier below the host keeps its own copy under its own bound: a page
evicted from one is gone from it only. Every method runs on the kvstore's event loop;
a tier that does I/O does it on threads of its own, and a fault of its own turns it
off (logged, in its stats) rather than failing a request: serving goes on without it.

**Adding a tier**: one module exposing ``TIER = TierSpec(name, SettingsClass, build)``
(``build(service_name, settings, events)``: the tier, or None when its settings leave
it off), named in the kvstore's ``tiers`` setting by its `BUILT_IN` name or its module
path. Its settings are the kvstore's when `KVStoreSettings` includes its class (the
disk tier's, ``RADIXSERVE_KVSTORE_DISK_*``), else its class reads them from the
environment under its own prefix. ``tests/kvstore/dict_tier.py`` is a complete one.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar

from pydantic_settings import BaseSettings

if TYPE_CHECKING:
    import torch

    from radixserve.cache.page_proof import PageProof
    from radixserve.services.kvstore.tier_events import TierEvents
    from radixserve.transfer import PoolCompat

#: the tiers built in, by name: the module that exposes each one's `TierSpec`
BUILT_IN = {"disk": "radixserve.services.kvstore.disk_pool"}


class KVTier(Protocol):
    """A tier of the kvstore (the host tier is one too). Pages are named by hash."""

    tier_name: str  # its name in the ``tiers`` setting, the prefix of its stats
    medium: str  # its pages' medium in the KV events ("CPU", "DISK", ...)

    @property
    def loaded(self) -> bool:
        """What the tier found at start is adopted (or there was none): the kvstore is
        not ready before (/health), since a request meanwhile would recompute it."""

    def holds(self, page_hash: int) -> bool:
        """Lookup: the page is stored and can be served now (no lease, no LRU touch)."""

    def proof(self, page_hash: int) -> PageProof | None:
        """The proof the page was stored with; None if it is not stored."""

    def hold(self, holder: str, page_hashes: Sequence[int]) -> int:
        """Lease: keep these stored pages (each `holds`) from eviction and unchanged until
        `release` of the id returned (a promotion holds its run while it reads it)."""

    def release(self, lease_id: int) -> None: ...

    def stats(self) -> dict[str, int | float]:
        """Its counters and gauges, named with its ``tier_name`` as prefix, besides
        ``kv_identity_mismatch_total`` (pages refused because their tokens do not give
        their hash), which the kvstore sums over its tiers."""

    async def stop(self) -> None: ...


class LowerTier(KVTier, Protocol):
    """A tier below the host tier: it is fed what the host tier evicts and read back
    into host pages on a lookup; the kvstore calls these, never a worker."""

    def open(self, compat: PoolCompat, host_kv: torch.Tensor) -> bool:
        """The host pool exists (``host_kv``: (L, 2, P, S, H, D), pages of ``compat``):
        called when the first worker attaches. Whether the tier serves (a lookup may
        read from it, `HostAttachAck.disk_tier`)."""

    def stage(self, page_hash: int, page: torch.Tensor, proof: PageProof | None) -> None:
        """Evict (into this tier): the host tier reuses ``page`` ((L, 2, S, H, D)) next,
        so copy its bytes now if the tier wants them; it may drop them (counted). A page
        is `holds` only once fully stored."""

    async def settle(self, page_hash: int, timeout_s: float) -> bool:
        """If the page was staged and is not stored yet, wait (at most ``timeout_s``)
        for a round of stores and say True; else False at once."""

    async def read(self, jobs: Sequence[tuple[int, int]]) -> list[bool]:
        """Promote: copy each held page (hash, host page) into that page of the host
        pool; per job, whether its bytes were valid (checked against its hash and
        proof). Only pages it says valid are committed to the host tier."""

    def read_s_per_page(self) -> float | None:
        """Measured seconds to read a page into host memory; None before a measure."""

    def chunk_pages(self, num_pages: int) -> int:
        """Pages per chunk of an overlapped promotion of ``num_pages``."""

    def promoted(self, good: list[int], bad: list[int], recomputed: int, overlapped: bool) -> None:
        """Count a promotion's pages of this tier: read valid (now in host memory: up its
        LRU), read invalid (drop them: never served again), past the cut (the worker
        computes them), and whether the read overlapped the worker's."""

    async def flush(self, pages: Iterable[tuple[int, torch.Tensor, PageProof | None]]) -> int:
        """At the kvstore's stop: `stage` the host tier's pages (least recently used
        first) within the tier's own time bound, so a restart finds them; how many."""


S = TypeVar("S", bound=BaseSettings)


@dataclass(frozen=True)
class TierSpec(Generic[S]):
    """How to build a tier: its name, its settings class, and its factory, which gives
    None when those settings leave it off."""

    name: str
    settings: type[S]
    build: Callable[[str, S, TierEvents | None], LowerTier | None]


def tier_spec(name: str) -> TierSpec[Any]:
    """The spec of tier ``name`` (a `BUILT_IN` name or a module path); ValueError if
    there is none."""
    try:
        module = importlib.import_module(BUILT_IN.get(name, name))
    except ImportError as exc:
        raise ValueError(f"no tier {name!r} (built in: {', '.join(BUILT_IN)}): {exc}") from exc
    spec = getattr(module, "TIER", None)
    if not isinstance(spec, TierSpec):
        raise ValueError(f"the module {module.__name__} exposes no TIER (a TierSpec)")
    return spec


def build_tiers(service: str, settings: BaseSettings, names: Sequence[str],
                events: TierEvents | None) -> list[LowerTier]:  # fmt: skip
    """The tiers ``names`` lists, in order, that their settings turn on."""
    tiers = []
    for name in names:
        spec = tier_spec(name)
        own = settings if isinstance(settings, spec.settings) else spec.settings()
        tier = spec.build(service, own, events)
        if tier is not None:
            tiers.append(tier)
    return tiers
