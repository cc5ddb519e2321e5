"""The kvstore's host-memory tier: a preallocated page pool that workers spill into.

The pool is one tensor in the pool layout (`KVPool`: L, 2, P, S, H, D), allocated when
the first worker attaches (its spill buffer's transfer metadata says the model, dtype and
page shape) with as many pages as ``capacity_gib`` holds, pinned when CUDA is present,
and registered with a transfer agent (NIXL or ZMQ, like the workers). `HostPageIndex`
keeps which page holds which chained page hash.

* **Spill** (`SpillOffer`): the worker has copied pages it evicted into its spill buffer;
  the kvstore recomputes each offered hash from the page's tokens and what it chains
  from (`PageProof`; a page whose hash it cannot recompute is refused, counted in
  ``host_spill_refused_pages_total`` and ``kv_identity_mismatch_total``, and logged),
  reserves host pages for the proved hashes it lacks, *reads* the buffer pages into
  them, makes them visible with their proofs and answers `SpillDone` so the worker
  reuses its buffer.
* **Load** (`HostLookup`): the kvstore leases the longest stored run of the asked hashes
  and answers `HostLease` with the host page ids and the tokens stored with them (the
  worker checks them against its prompt first); the worker reads them into its device
  pool and sends `HostRelease`. A leased page is never evicted; a lease not released
  within ``lease_s`` (a reader that died) ends on its own. It is not ended sooner when
  its worker is declared lost: a worker that was only silent may still be reading, and
  its reads have a deadline (``host_load_timeout_s``) below ``lease_s``.

Every transfer is a pull by the side that receives, so one read primitive serves both
directions. While pages are leased the kvstore drives its agent (`serve_reads`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterator, Sequence

import torch

from radixserve.cache.host_index import HostPageIndex
from radixserve.cache.page_proof import PageProof, chain_proofs, unpack_tokens
from radixserve.protocol import HostAttachAck, HostLease, HostLookup, SpillOffer
from radixserve.runtime.kv_events import MEDIUM_CPU
from radixserve.runtime.network import transfer_network
from radixserve.services.kvstore.settings import KVStoreSettings
from radixserve.services.kvstore.tier import LowerTier
from radixserve.services.kvstore.tier_events import TierEvents
from radixserve.transfer import (
    KVTransferAgent,
    PoolCompat,
    TransferError,
    create_agent,
    peer_compat,
)

logger = logging.getLogger(__name__)


def spill_agent_name(worker: str) -> str:
    """The transfer agent name of ``worker``'s spill buffer."""
    return f"{worker}.spill"


class HostPool:
    """The host tier (a `KVTier`, the top one): host pages, their index and the agent
    that moves them; driven by the kvstore."""

    tier_name, medium, loaded = "host", MEDIUM_CPU, True

    def __init__(
        self,
        name: str,
        settings: KVStoreSettings,
        below: Sequence[LowerTier] = (),
        events: TierEvents | None = None,
    ) -> None:
        """``below``: the tiers each stored page is staged into before it is reused;
        ``events``: publishes the pages stored and evicted (medium "CPU")."""
        self.name, self.settings, self.below, self.events = name, settings, below, events
        self.capacity_bytes = int(settings.host_capacity_gib * (1 << 30))
        self.network = transfer_network(settings)
        self.compat: PoolCompat | None = None
        self.kv: torch.Tensor | None = None
        self.agent: KVTransferAgent | None = None
        self.index: HostPageIndex | None = None
        self.counters = {
            "host_spill_offers_total": 0,
            "host_spill_failures_total": 0,
            "host_spill_refused_pages_total": 0,
            "kv_identity_mismatch_total": 0,
            "host_lookups_total": 0,
            "host_bytes_stored_total": 0,
        }
        self._connections: dict[str, bytes] = {}  # worker -> connection it attached on
        self._leased = asyncio.Event()
        self._server: asyncio.Task | None = None

    async def stop(self) -> None:
        if self._server is not None:
            self._server.cancel()
            await asyncio.gather(self._server, return_exceptions=True)
        if self.agent is not None:
            self.agent.close()

    # -- attach -----------------------------------------------------------------------

    def attach(
        self, worker: str, generation: int, metadata: bytes, connection: bytes = b""
    ) -> HostAttachAck:
        """Let ``worker`` (at ``generation``, on ``connection``) spill into and load from
        the pool."""
        if not self.capacity_bytes:
            return HostAttachAck(False, reason="this kvstore has no host tier (capacity 0)")
        try:
            compat = peer_compat(metadata, self.network.keys)
        except TransferError as exc:
            return HostAttachAck(False, reason=f"spill buffer metadata: {exc}")
        if self.agent is None:
            try:
                self._allocate(compat)
            except (TransferError, ValueError, RuntimeError) as exc:
                return HostAttachAck(False, reason=f"cannot set up the host pool: {exc}")
        assert self.agent is not None and self.index is not None and self.compat is not None
        if compat.digest != self.compat.digest:
            diff = "; ".join(self.compat.mismatches(compat))
            return HostAttachAck(False, reason=f"the host pool holds other pages: {diff}")
        try:
            self.agent.add_peer(spill_agent_name(worker), generation, metadata)
        except TransferError as exc:
            return HostAttachAck(False, reason=str(exc))
        self._connections[worker] = connection
        logger.info("%s: %s attached to the host tier", self.name, worker)
        return HostAttachAck(True, self.agent.metadata(), self.index.num_pages)

    def _allocate(self, compat: PoolCompat) -> None:
        dtype = getattr(torch, compat.dtype)
        page_bytes = compat.page_bytes
        num_pages = self.capacity_bytes // page_bytes
        if num_pages < 1:
            raise ValueError(
                f"{self.capacity_bytes} bytes hold no page of {page_bytes} bytes; "
                "raise host_capacity_gib"
            )
        shape = (
            compat.num_layers, 2, num_pages, compat.page_size, compat.num_kv_heads,
            compat.head_dim,
        )  # fmt: skip
        kv = torch.empty(shape, dtype=dtype, pin_memory=torch.cuda.is_available())
        s = self.settings
        self.agent = create_agent(s.transfer_backend, self.name, kv, compat,
                                  s.host_transfer_timeout_s, s.nixl_progress_thread, self.network)  # fmt: skip
        self.kv, self.compat = kv, compat
        # a worker reads only the pages leased to it, while leased (ZMQ enforces it;
        # NIXL's reads are one-sided and only keep the ledger)
        self.agent.enforce_grants()
        self._granted: dict[int, tuple[str, list[int]]] = {}  # lease id → (worker, pages)
        self.index = HostPageIndex(num_pages, self._evicted, self._lease_ended)
        # drive the agent while workers may read leased pages; expire forgotten leases
        index = self.index
        self._server = asyncio.create_task(
            self.agent.serve_reads_while(
                lambda: bool(index.num_leases), self._leased, self._expire_leases
            )
        )
        logger.info("%s: host tier of %d pages (%.2f GiB) for %s", self.name, num_pages,
                    kv.nbytes / (1 << 30), compat.model_name)  # fmt: skip

    def _evicted(self, page_hash: int, page: int, proof: PageProof | None) -> None:
        """The index evicts ``page`` (it held ``page_hash``) to reuse it."""
        if self.events is not None:
            self.events.removed(MEDIUM_CPU, [page_hash])
        assert self.kv is not None  # allocated with the index
        for tier in self.below:
            tier.stage(page_hash, self.kv[:, :, page], proof)

    def worker_on(self, connection: bytes, named: str) -> str:
        """The worker speaking on ``connection``: ``named`` (its hello's name), or, for a
        connection that spoke before its hello (across this kvstore's restart), the
        worker that attached on it."""
        if named != "?":
            return named
        return next((w for w, c in self._connections.items() if c == connection), named)

    def detach(self, worker: str, connection: bytes = b"") -> None:
        """The ``connection`` of ``worker`` was lost: fail its pending spill reads, unless
        a newer incarnation of it has attached meanwhile. (Its leases run out.)"""
        if self.agent is None or self._connections.get(worker) != connection:
            return
        del self._connections[worker]
        self.agent.remove_peer(spill_agent_name(worker))

    # -- spill and load ---------------------------------------------------------------

    async def spill(self, worker: str, offer: SpillOffer) -> int:
        """Copy the offered pages the pool lacks out of ``worker``'s spill buffer; the
        number of pages stored."""
        if self.agent is None or self.index is None:
            return 0
        self.counters["host_spill_offers_total"] += 1
        proved = self._proved(worker, offer)
        hashes = list(proved)
        reserved = self.index.reserve(hashes)
        if not reserved:
            return 0
        mine = [hashes[i] for i, _ in reserved]
        index_of = {h: i for i, h in enumerate(offer.page_hashes)}
        src = [offer.buffer_page_ids[index_of[h]] for h in mine]
        dst = [page for _, page in reserved]
        ok = False
        try:
            handle = self.agent.read_pages(spill_agent_name(worker), src, dst)
            ok = await self.agent.wait_async(handle) == "done"
        except TransferError as exc:
            logger.warning("%s: spill from %s failed: %s", self.name, worker, exc)
        except asyncio.CancelledError:  # wait_async removed the peer: the read cannot land
            self.index.abort(mine)
            raise
        if not ok:
            self.counters["host_spill_failures_total"] += 1
            self.index.abort(mine)
            return 0
        self.commit(mine, [proved[h] for h in mine])
        assert self.compat is not None  # allocated with the index
        self.counters["host_bytes_stored_total"] += len(dst) * self.compat.page_bytes
        return len(dst)

    def _proved(self, worker: str, offer: SpillOffer) -> dict[int, PageProof]:
        """The offered pages whose hash the kvstore recomputes from their tokens (in
        order), with their proofs; the others are refused, counted and logged."""
        assert self.compat is not None
        hashes, size = offer.page_hashes, self.compat.page_size
        proved: dict[int, PageProof] = {}
        if len(offer.token_ids) == size * len(hashes) and offer.runs:
            first = 0
            for run in offer.runs:
                parent = run.parent[0] if run.parent else None
                tokens = offer.token_ids[first * size : (first + run.num_pages) * size]
                run_hashes = hashes[first : first + run.num_pages]
                for h, proof in zip(run_hashes, chain_proofs(run.namespace, parent, tokens,
                                                              run_hashes)):  # fmt: skip
                    if proof.verifies(h):
                        proved[h] = proof
                first += run.num_pages
        refused = len(hashes) - len(proved)
        if refused:
            self.counters["host_spill_refused_pages_total"] += refused
            self.counters["kv_identity_mismatch_total"] += refused
            logger.warning("%s: refused %d of %d pages spilled by %s: their tokens do not "
                           "give their hashes", self.name, refused, len(hashes), worker)  # fmt: skip
        return proved

    def commit(self, page_hashes: list[int], proofs: list[PageProof]) -> None:
        """Make reserved pages, now written, visible with their proofs (a spill's, or a
        promotion's from a tier below)."""
        assert self.index is not None
        self.index.commit(page_hashes, proofs)
        if self.events is not None:
            self.events.stored(MEDIUM_CPU, page_hashes, proofs)

    def tokens_of(self, page_hashes: list[int], lower_proof: Callable[[int], PageProof | None]
                  ) -> tuple[int, ...]:  # fmt: skip
        """The stored tokens of ``page_hashes`` (host pages' proofs, else ``lower_proof``'s,
        for pages being read from a tier below), concatenated; empty if one has none."""
        assert self.index is not None
        out: list[int] = []
        for h in page_hashes:
            proof = self.index.proof(h) or lower_proof(h)
            if proof is None:
                return ()
            out += unpack_tokens(proof.tokens)
        return tuple(out)

    def lookup(self, worker: str, msg: HostLookup) -> HostLease:
        """Lease the longest stored run of the asked hashes for ``worker`` (pages the
        tiers below hold were promoted into it first: `Promotion.promote`)."""
        if self.index is None:
            return HostLease(msg.query_id)
        self.counters["host_lookups_total"] += 1
        lease_id, pages = self.index.lease(
            worker, list(msg.page_hashes), time.monotonic() + self.settings.host_lease_s
        )
        if lease_id:
            self._grant(lease_id, worker, pages)
        tokens = self.tokens_of(list(msg.page_hashes[: len(pages)]), lambda h: None)
        return HostLease(msg.query_id, lease_id, tuple(pages), token_ids=tokens)

    def lease_loading(
        self,
        worker: str,
        msg: HostLookup,
        run: list[int],
        ready: int,
        lower_proof: Callable[[int], PageProof | None],
    ) -> HostLease:
        """Lease ``run`` (the leading hashes of ``msg``) to ``worker`` while the tiers
        below are still reading its pages past the first ``ready`` into their reserved
        host pages (`Promotion.promote` with ``on_plan``; ``lower_proof``: their proofs
        of those)."""
        assert self.index is not None
        self.counters["host_lookups_total"] += 1
        if not run:
            return HostLease(msg.query_id)
        lease_id, pages = self.index.hold_run(
            worker, run, time.monotonic() + self.settings.host_lease_s
        )
        self._grant(lease_id, worker, pages)
        disk_pages = len(run) - sum(self.index.stored(h) for h in run)
        tokens = self.tokens_of(run, lower_proof)
        return HostLease(msg.query_id, lease_id, tuple(pages), disk_pages, True, ready, tokens)

    def release(self, lease_id: int) -> None:
        if self.index is not None:
            self.index.release(lease_id)

    # -- as a tier (`KVTier`) ---------------------------------------------------------

    def holds(self, page_hash: int) -> bool:
        return self.index is not None and self.index.stored(page_hash)

    def proof(self, page_hash: int) -> PageProof | None:
        return self.index.proof(page_hash) if self.index is not None else None

    def hold(self, holder: str, page_hashes: Sequence[int]) -> int:
        assert self.index is not None
        return self.index.hold(holder, page_hashes, math.inf)[0]

    def stored_pages(self) -> Iterator[tuple[int, torch.Tensor, PageProof | None]]:
        """(hash, page (L, 2, S, H, D), proof) of the stored pages, least recently used
        first (what a tier below writes at the kvstore's stop)."""
        if self.index is None or self.kv is None:
            return
        for page_hash, page in self.index.stored_pages():
            yield page_hash, self.kv[:, :, page], self.index.proof(page_hash)

    def _grant(self, lease_id: int, worker: str, pages: list[int]) -> None:
        """Let ``worker`` read the leased ``pages``, and drive the agent while it may."""
        assert self.agent is not None
        self.agent.grant(worker, pages)
        self._granted[lease_id] = (worker, pages)
        self._leased.set()

    def _lease_ended(self, lease_id: int) -> None:
        """A lease was released or expired: its pages are no longer its worker's to read."""
        granted = self._granted.pop(lease_id, None)
        if granted is not None and self.agent is not None:
            self.agent.revoke(*granted)

    def _expire_leases(self) -> None:
        assert self.index is not None
        expired = self.index.expire(time.monotonic())
        if expired:
            logger.warning("%s: %d host-tier leases expired unreleased", self.name, expired)

    def stats(self) -> dict[str, int | float]:
        stats: dict[str, int | float] = dict(self.counters)
        if self.index is not None:
            stats.update(self.index.stats())
        return stats
