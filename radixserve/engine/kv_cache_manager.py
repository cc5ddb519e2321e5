"""The one owner of the KV pool's pages: who holds each page, and why.

Every page of the pool is, at any moment, in exactly one of these states:

    free ────── allocate() ─────► held by a request (`Request.page_ids`, one reference
      ▲  (evict if short, then       each; its cached prefix locked: `locked_node`)
      │   allocate: the only path)      │ release(cache_kv) / share(): full pages go
      │                                 ▼ into the tree, which takes its own reference
      └── last reference dropped ◄── cached (the radix tree's reference; evictable
                                        when no request locks its node)
    and besides: leased (a prefill's prompt kept for a reader, `lease`), loading (a
    host-tier read's pages, `begin_host_load`), an audit shadow's (`allocate`/`drop`)

`KVCacheManager` is the only code that allocates, references, locks, evicts, leases,
forks and loads pages; nothing else imports the allocator or the radix tree
(`tests/test_layout.py`). Who calls what:

* `Scheduler`: `match`, `admit`, `grow` (it preempts and retries when `grow` fails),
  `fork`, `share`, `release`;
* `Engine` (admission and disaggregation): `match`, `lease`, `release_lease`,
  `expire_leases`, `begin_host_load`, `finish_host_load`, `distrust`, `trust_again`,
  `stats`, `check_integrity`;
* `CacheAudit` and the engine's idle step: `allocate` and `drop` for the shadow's pages;
* read only: the operator's view (`cache_view.describe`: ``cache``, ``host_loads``,
  ``leases``), the spill hook (`SpillHook`: the cache's spill listener), the tests.

Invariants (`check_integrity`): the allocator's and the tree's own; every reference is
the tree's, a live request's, a lease's or a host load's (so at rest every used page is
cached); the tree's locks are the live requests' and the host loads'; reserved pages
belong to live requests. Pure Python, no tensors; not thread-safe (the engine thread).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import MatchResult, RadixCache
from radixserve.cache.radix_tree import RadixNode
from radixserve.engine.lease import LeaseTable
from radixserve.engine.request import Request

logger = logging.getLogger(__name__)


@dataclass
class HostLoad:
    """A request waiting for its host-tier read: the prefix it will cache when done."""

    tokens: list[int]  # the prefix that will be cached: device head + loaded pages
    head_pages: list[int]  # the device-cached head, locked through `node`
    page_ids: list[int]  # the pages the host-tier read fills, in order
    node: RadixNode
    namespace: bytes | None = None  # the request's (`Request.namespace`)


class KVCacheManager:
    """``num_pages`` pages of ``page_size`` tokens; a request's pages come in runs of
    ``run_pages`` (the CPU decode attention's block, passed in by the engine); with a
    ``namespace`` a prefix cache (`RadixCache`) keeps finished KV, without one none."""

    def __init__(
        self, num_pages: int, page_size: int, run_pages: int = 1, namespace: bytes | None = None
    ) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.run_pages = run_pages
        self.cache = None if namespace is None else RadixCache(self.allocator, page_size, namespace)
        self.leases = LeaseTable()
        self.host_loads: dict[str, HostLoad] = {}  # by request id
        # False while a failed-closed cache audit waits for an operator (`distrust`):
        # nothing is matched, every prompt is computed
        self.serve_from_cache = True

    # -- lookups ----------------------------------------------------------------------

    def match(self, req: Request) -> MatchResult | None:
        """``req``'s longest cached prefix in its cache scope (`Request.namespace`;
        never its last token: its logits are needed), walked once and kept while the
        tree has not changed (`RadixCache.version`): the engine's admission, the
        scheduler's short-delta check and `admit` share one walk. None without a cache,
        for a scored prompt (it computes all of it) and while `serve_from_cache` is off."""
        if self.cache is None or req.scores_prompt or not self.serve_from_cache:
            return None
        kept = req.match
        if kept is None or kept[0] != self.cache.version or kept[1] != req.num_tokens:
            match = self.cache.match_prefix(req.token_ids[: req.num_tokens - 1], req.namespace)
            kept = req.match = (self.cache.version, req.num_tokens, match)
        return kept[2]

    # -- a request's pages (the scheduler) --------------------------------------------

    def admit(self, req: Request) -> None:
        """Point a waiting request at its longest cached prefix (locked), if caching."""
        match = self.match(req)
        req.match = None  # used: the next admission (after a preemption) walks again
        if match is not None:
            assert self.cache is not None
            self.allocator.incref(match.page_ids)
            self.cache.lock(match.node)
            if match.num_tokens:
                self.cache.note_use(match.node, req.request_id)
            req.locked_node = match.node
            req.page_ids = list(match.page_ids)
            req.num_computed = match.num_tokens
        if not req.admitted_once:
            req.cached = req.cached.with_total(req.num_computed)
            req.admitted_once = True

    def grow(self, req: Request, num_tokens: int) -> bool:
        """Give ``req`` pages for ``num_tokens`` tokens (and reserve the rest of its run);
        False, with nothing allocated, if even evicting cannot free enough."""
        need = -(-num_tokens // self.page_size) - len(req.page_ids)
        if need <= 0:
            return True
        spare = self._spare_pages(req, len(req.page_ids) + need)
        pages = self.allocate(need, req.request_id, spare)
        if pages is None:
            return False
        req.page_ids.extend(pages)
        return True

    def fork(self, parent: Request, child: Request, copy_page: Callable[[int, int], None]) -> bool:
        """Give ``child`` ``parent``'s computed tokens: the full pages shared (one more
        reference each, the cache node locked once more), the partial last page copied
        (``copy_page(src, dst)``). False, with nothing held, if no page is found for it."""
        num = parent.num_computed
        full = num // self.page_size
        tail: list[int] = []
        if num % self.page_size:
            got = self.allocate(1, child.request_id, self._spare_pages(child, full + 1))
            if got is None:
                return False
            tail = got
            copy_page(parent.page_ids[full], tail[0])
        shared = parent.page_ids[:full]
        self.allocator.incref(shared)
        if parent.locked_node is not None:
            assert self.cache is not None
            self.cache.lock(parent.locked_node)
        child.locked_node = parent.locked_node
        child.page_ids = shared + tail
        child.num_computed = num
        child.admitted_once = True
        return True

    def share(self, req: Request) -> None:
        """Insert a running request's full pages and re-point it at the cache's copies,
        so concurrent requests sharing the prefix reuse them at once."""
        num_pages = req.num_computed // self.page_size
        if self.cache is None or num_pages == 0:
            return
        tokens = req.token_ids[: num_pages * self.page_size]
        match = self.cache.insert_path(tokens, req.page_ids[:num_pages], req.namespace)
        for i, canonical in enumerate(match.page_ids):
            mine = req.page_ids[i]
            if mine != canonical:
                self.allocator.incref([canonical])
                self.allocator.decref([mine])
                req.page_ids[i] = canonical
        self.cache.lock(match.node)
        if req.locked_node is not None:
            self.cache.unlock(req.locked_node)
        req.locked_node = match.node

    def release(self, req: Request, cache_kv: bool) -> None:
        """Return every page of ``req`` (its full computed pages into the cache first if
        ``cache_kv``), its reservation and its lock; it has no KV afterwards."""
        if self.cache is not None and cache_kv:
            aligned = min(req.num_computed // self.page_size, len(req.page_ids))
            if aligned:
                tokens = req.token_ids[: aligned * self.page_size]
                self.cache.insert(tokens, req.page_ids[:aligned], req.namespace)
        self.allocator.decref(req.page_ids)
        self.allocator.release(req.request_id)
        if req.locked_node is not None:
            assert self.cache is not None
            self.cache.unlock(req.locked_node)
        req.page_ids = []
        req.locked_node = None
        req.num_computed = 0  # no page: no KV

    def _spare_pages(self, req: Request, num_pages: int) -> int:
        """Pages to reserve for ``req`` after its first ``num_pages``: to the end of their
        run of `run_pages` (a whole next run if they end one), at most as many as its
        prompt and ``max_tokens`` can still fill."""
        spare = -num_pages % self.run_pages or self.run_pages
        most = -(-(len(req.prompt_ids) + req.params.max_tokens) // self.page_size)
        return max(0, min(spare, most - num_pages))

    # -- pages of other holders -------------------------------------------------------

    def allocate(self, n: int, owner: str | None = None, spare: int = 0) -> list[int] | None:
        """``n`` pages (each one reference, the caller's), evicting unlocked cached pages
        if fewer are free; None, with nothing allocated, if that is not enough. With an
        ``owner``, its reservation is used and ``spare`` more reserved (`PageAllocator`)."""
        while self.allocator.num_free < n:  # an evicted page a request holds is not freed
            short = n - self.allocator.num_free
            if self.cache is None or self.cache.evict(short) < short:
                return None
        return self.allocator.alloc(max(0, n), owner=owner, spare=spare)

    def drop(self, page_ids: list[int]) -> None:
        """Drop the caller's reference on each of ``page_ids`` (from `allocate`)."""
        self.allocator.decref(page_ids)

    def lease(self, request_id: str, page_ids: list[int], expires_at: float) -> None:
        """Keep ``page_ids`` alive for a reader until `release_lease` or ``expires_at``."""
        self.leases.hold(request_id, page_ids, expires_at)
        self.allocator.incref(page_ids)

    def release_lease(self, request_id: str) -> bool:
        """Drop a lease's references; False if there is none (released or expired)."""
        pages = self.leases.pop(request_id)
        if pages is not None:
            self.allocator.decref(pages)
        return pages is not None

    def expire_leases(self, now: float) -> None:
        for request_id in self.leases.expired(now):
            self.release_lease(request_id)

    def begin_host_load(self, req: Request, match: MatchResult, num_pages: int) -> list[int] | None:
        """Lock ``req``'s device-cached head (``match``) and allocate ``num_pages`` pages
        for the host-tier read; None (nothing held) if the pool cannot spare them."""
        assert self.cache is not None
        self.cache.lock(match.node)
        pages = self.allocate(num_pages)
        if pages is None:
            self.cache.unlock(match.node)
            return None
        tokens = req.token_ids[: match.num_tokens + num_pages * self.page_size]
        load = HostLoad(tokens, list(match.page_ids), pages, match.node, req.namespace)
        self.host_loads[req.request_id] = load
        return list(pages)

    def finish_host_load(self, request_id: str, ok: bool) -> int | None:
        """The read ended: if ``ok`` its prefix goes into the cache; the pages and the
        lock are let go. The pages it loaded (0 unless ``ok``); None for an unknown id."""
        load = self.host_loads.pop(request_id, None)
        if load is None:
            return None
        assert self.cache is not None
        if ok:
            self.cache.insert(load.tokens, load.head_pages + load.page_ids, load.namespace)
        self.allocator.decref(load.page_ids)
        self.cache.unlock(load.node)
        return len(load.page_ids) if ok else 0

    # -- the cache audit's verdicts ---------------------------------------------------

    def distrust(self) -> int:
        """Serve nothing from the cache and drop every page it can let go now (none
        handed to the host tier); returns how many."""
        self.serve_from_cache = False
        return self.cache.drop_unlocked() if self.cache is not None else 0

    def trust_again(self) -> bool:
        """Drop what the cache holds now and serve from it again; whether it had not."""
        failed = not self.serve_from_cache
        if failed and self.cache is not None:
            self.cache.drop_unlocked()
            logger.warning("cache audit cleared: the cache serves again")
        self.serve_from_cache = True
        return failed

    # -- accounting -------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """Pool pages: used, free (of which reserved for running requests' next pages),
        references held outside the cache, and (with the cache) cached, locked,
        evictable and the locks held."""
        alloc, cache = self.allocator, self.cache
        cached = cache.num_cached_pages if cache is not None else 0
        stats = {
            "pages_total": alloc.num_pages,
            "pages_used": alloc.num_used,
            "pages_free": alloc.num_free,  # reserved pages included: any request may take them
            "pages_reserved": alloc.num_reserved,
            "leases": len(self.leases),
            "host_loads_in_flight": len(self.host_loads),
            # references held by anything but the tree (requests, leases, host loads): 0 at rest
            "page_refs_outside_cache": alloc.num_refs - cached,
        }
        if cache is not None:
            stats["pages_cached"] = cached
            stats["pages_locked"] = cache.num_locked_pages
            stats["pages_evictable"] = cache.num_evictable_pages
            stats["cache_locks"] = cache.num_locks
            stats["radix_matches_total"] = cache.num_matches
        return stats

    def check_integrity(self, requests: Iterable[Request]) -> None:
        """Raise ``AssertionError`` unless every page is accounted for (module notes),
        given every live holder of pages: ``requests`` (an audit shadow's included).
        Changes nothing. O(pages + nodes)."""
        requests = list(requests)
        self.allocator.check_integrity()
        if self.cache is not None:
            self.cache.check_integrity()
        cached = self.cache.num_cached_pages if self.cache is not None else 0
        held = sum(len(r.page_ids) for r in requests)
        held += sum(len(self.leases.pages(rid) or ()) for rid in self.leases.request_ids())
        held += sum(len(load.page_ids) for load in self.host_loads.values())
        refs = self.allocator.num_refs
        if refs != cached + held:
            raise AssertionError(f"{refs} page references, {cached} cached + {held} held")
        locks = sum(r.locked_node is not None for r in requests) + len(self.host_loads)
        if self.cache is not None and self.cache.num_locks != locks:
            raise AssertionError(f"{self.cache.num_locks} cache locks, {locks} holders")
        if not any(r.page_ids for r in requests) and self.allocator.num_reserved:
            raise AssertionError(f"{self.allocator.num_reserved} pages reserved for no request")
