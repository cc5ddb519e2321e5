"""Promotion: on a `HostLookup`, the pages of its run held below the host tier are read
back into host memory, so the worker's lease covers them (`Promotion.promote`).

The run is the leading run of the asked hashes each held by some tier, per page the
fastest (`Promotion.run`); `promotion_cut` keeps the part worth reading at each tier's
measured read rate against the asking worker's prefill rate (a worker that recomputes
faster gets only what is in host memory). A page that fails its tier's check is
dropped there and never served: the run stops at it and the worker computes the rest.
One promotion runs at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from radixserve.cache.page_proof import PageProof
from radixserve.services.kvstore.host_pool import HostPool
from radixserve.services.kvstore.tier import KVTier, LowerTier

_HOLDER = "promotion"
_WRITTEN_WAIT_S = 0.5  # longest wait of a promotion for pages of its run being stored

OnPlan = Callable[[list[int], int], Awaitable[None]]
OnReady = Callable[[int, bool], Awaitable[None]]


@dataclass
class _Run:
    """A promotion's run: its hashes in order and, per page, the tier it is read from
    (the host tier: it is in host memory already)."""

    hashes: list[int]
    tiers: list[KVTier]
    host: HostPool

    def of(self, tier: KVTier) -> list[int]:
        return [h for h, t in zip(self.hashes, self.tiers) if t is tier]

    def cut_at_unreserved(self, reserved: set[int]) -> None:
        """End the run before its first page to read without a host page to go to."""
        n = self.ready(reserved)
        del self.hashes[n:], self.tiers[n:]

    def ready(self, read: set[int]) -> int:
        """Its leading pages readable once the pages ``read`` are in host memory."""
        pending = (i for i, (h, t) in enumerate(zip(self.hashes, self.tiers))
                   if t is not self.host and h not in read)  # fmt: skip
        return next(pending, len(self.hashes))


def promotion_cut(read_s: Sequence[float | None], recompute_s_per_page: float | None) -> int:
    """How many leading pages of a run to load rather than recompute: the length that
    saves the most time when page i costs ``read_s[i]`` to bring into host memory (0:
    it is there) and computing a page costs ``recompute_s_per_page``. An unknown rate
    (None or 0) loads the whole run."""
    if not recompute_s_per_page or any(s is None for s in read_s):
        return len(read_s)
    best, gain, best_gain = 0, 0.0, 0.0
    for i, seconds in enumerate(read_s):
        gain += recompute_s_per_page - (seconds or 0.0)
        if gain > best_gain:
            best, best_gain = i + 1, gain
    return best


class Promotion:
    """Reads runs from the tiers ``below`` into the ``host`` tier; driven by the kvstore."""

    def __init__(self, host: HostPool, below: Sequence[LowerTier]) -> None:
        self.host, self.below = host, below
        self._promoting = asyncio.Lock()

    def run(self, page_hashes: Sequence[int]) -> list[KVTier]:
        """The leading run of ``page_hashes`` the tiers hold: per page, the fastest."""
        tiers: list[KVTier] = [self.host, *self.below]
        out: list[KVTier] = []
        if self.host.index is None:  # no worker attached yet: no layout to serve
            return out
        for h in page_hashes:
            tier = next((t for t in tiers if t.holds(h)), None)
            if tier is None:
                break
            out.append(tier)
        return out

    def proof(self, page_hash: int) -> PageProof | None:
        """A tier below's proof of ``page_hash`` (for a page still being read)."""
        return next((p for t in self.below if (p := t.proof(page_hash)) is not None), None)

    async def promote(
        self,
        page_hashes: Sequence[int],
        prefill_tokens_per_s: float,
        on_plan: OnPlan | None = None,
        on_ready: OnReady | None = None,
    ) -> set[int]:
        """Read the lower tiers' pages of the leading run of ``page_hashes`` into the
        host tier when that is quicker than recomputing them at ``prefill_tokens_per_s``
        (0: unknown); the hashes read. With ``on_plan``, the read overlaps the worker's
        when it takes more than one chunk: once host pages are reserved, ``on_plan(run,
        ready)`` gets the run to lease (host pages and pages being read, in order) and
        how many of it are readable already, then the pages are read in chunks and
        after each one ``on_ready(ready, failed)`` says how many are readable now
        (``failed``: the page after them failed and the rest never comes). Without a
        call of ``on_plan`` the caller leases the run afterwards."""
        if self.host.index is None or not self._lower(await self._settled_run(page_hashes)):
            return set()
        async with self._promoting:
            tiers = self.run(page_hashes)  # again: it may have changed meanwhile
            compat = self.host.compat
            assert compat is not None
            recompute = compat.page_size / prefill_tokens_per_s if prefill_tokens_per_s else None
            read_s = {id(t): t.read_s_per_page() for t in self.below}
            n = promotion_cut([read_s.get(id(t), 0.0) for t in tiers], recompute)
            run = _Run(list(page_hashes[:n]), tiers[:n], self.host)
            involved = self._lower(tiers)
            recomputed = {id(t): sum(x is t for x in tiers[n:]) for t in involved}
            if not self._lower(run.tiers):
                for tier in involved:
                    tier.promoted([], [], recomputed[id(tier)], False)
                return set()
            return await self._read_into(run, involved, recomputed, on_plan, on_ready)

    def _lower(self, tiers: list[KVTier]) -> list[LowerTier]:
        """The tiers below the host that ``tiers`` names, in order."""
        return [t for t in self.below if any(x is t for x in tiers)]

    async def _settled_run(self, page_hashes: Sequence[int]) -> list[KVTier]:
        """`run`, once the pages of it on their way to a tier are stored (at most
        `_WRITTEN_WAIT_S`): a page the host tier evicted a moment ago is read back once
        it is stored, rather than recomputed, and never before."""
        deadline = time.monotonic() + _WRITTEN_WAIT_S
        while True:
            tiers = self.run(page_hashes)
            left, n = deadline - time.monotonic(), len(tiers)
            if n == len(page_hashes) or left <= 0:
                return tiers
            for tier in self.below:
                if await tier.settle(page_hashes[n], left):
                    break
            else:
                return tiers

    async def _read_into(
        self,
        run: _Run,
        involved: list[LowerTier],
        recomputed: dict[int, int],
        on_plan: OnPlan | None,
        on_ready: OnReady | None,
    ) -> set[int]:
        """Read the run's lower pages into newly reserved host pages, holding its pages
        in every tier meanwhile; in chunks told to ``on_ready`` when there is an
        ``on_plan`` (see `promote`), else in one go."""
        host, index = self.host, self.host.index
        assert index is not None
        want = [h for h, t in zip(run.hashes, run.tiers) if t is not host]
        tier_of = {h: t for h, t in zip(run.hashes, run.tiers)}
        holds = [(host, host.hold(_HOLDER, run.of(host)))]
        holds += [(t, t.hold(_HOLDER, run.of(t))) for t in involved]
        reserved = index.reserve(want)  # may evict other host pages (towards the tiers)
        jobs = [(want[j], page) for j, page in reserved]
        proofs = {h: tier_of[h].proof(h) for h in want}
        run.cut_at_unreserved({want[j] for j, _ in reserved})
        good: list[int] = []
        bad: list[int] = []
        size = max(1, len(jobs))
        if on_plan is not None:
            size = max(t.chunk_pages(len(jobs)) for t in involved)
        overlap = on_plan is not None and size < len(jobs)  # one chunk: nothing to overlap
        try:
            if overlap and on_plan is not None:
                await on_plan(run.hashes, run.ready(set()))
            for first in range(0, len(jobs), size):
                chunk = jobs[first : first + size]
                ok = await self._read_chunk(chunk, tier_of)
                mine = [h for (h, _), fine in zip(chunk, ok) if fine]
                good += mine
                bad += [h for (h, _), fine in zip(chunk, ok) if not fine]
                host.commit(mine, [proofs[h] for h in mine])  # type: ignore[misc]
                if overlap and on_ready is not None:
                    await on_ready(run.ready(set(good)), bool(bad))
                if bad:
                    break
        finally:  # (cancelled: the kvstore is stopping; a reader may still fill pages)
            done = set(good)
            index.abort([h for h, _ in jobs if h not in done])
            for tier, lease_id in holds:
                tier.release(lease_id)
            for tier in involved:
                tier.promoted([h for h in good if tier_of[h] is tier],
                              [h for h in bad if tier_of[h] is tier],
                              recomputed[id(tier)], overlap)  # fmt: skip
        return done

    async def _read_chunk(
        self, chunk: list[tuple[int, int]], tier_of: dict[int, KVTier]
    ) -> list[bool]:
        """Each (hash, host page) of ``chunk`` read by its tier, in order."""
        ok: dict[int, bool] = {}
        for tier in self.below:
            jobs = [job for job in chunk if tier_of[job[0]] is tier]
            if jobs:
                ok.update(zip((h for h, _ in jobs), await tier.read(jobs)))
        return [ok[h] for h, _ in chunk]
