"""What the gateway knows of its workers, from their links: whether it waits for the
kvstore's tiers (/health), the pool totals (/metrics), and each worker's `WorkerView`
(/debug/cache, /metrics, the explorer), read by attribute from the typed heartbeat
(`ServiceStats`); and what it asks them for the operator (`WorkerQuestions`)."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterable
from typing import Any

from radixserve.protocol.link_messages import HelloAck
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.protocol.view_messages import (
    CacheAuditClear,
    CacheAuditCleared,
    CacheTreeQuery,
    CacheTreeReply,
)
from radixserve.protocol.wire import Message
from radixserve.runtime.calls import Replies
from radixserve.runtime.links import Link
from radixserve.runtime.page_geometry import peer_identity
from radixserve.runtime.routing.router import DecodeRouter
from radixserve.worker_metrics import WorkerView


def identity_of(ack: HelloAck | None, refused: str) -> dict[str, Any] | None:
    """A worker's model identity for /debug/cache, with why it was refused, if it was."""
    if ack is None and not refused:
        return None
    identity = None
    with contextlib.suppress(ValueError):
        identity = peer_identity(ack) if ack is not None else None
    entry: dict[str, Any] = {**identity.to_dict(), "short": identity.short} if identity else {}
    return {**entry, "refused": refused} if refused else entry or None


def _disk_ready(stats: ServiceStats | None) -> bool:
    """A kvstore heard from whose disk tier (if any) has adopted its files."""
    if stats is None:
        return False
    disk = stats.kvstore.disk if stats.kvstore is not None else None
    return disk is None or bool(disk.disk_tier_ready)


def _attach_settled(stats: ServiceStats | None) -> bool:
    """A worker heard from whose host-tier attach (if any) the kvstore answered."""
    if stats is None:
        return False
    return stats.host_tier is None or bool(stats.host_tier.host_attach_settled)


def kvstore_waiting(kvstores: Iterable[Link], workers: Iterable[Link]) -> list[str]:
    """The links the gateway is not ready without: a kvstore up but still adopting its
    disk tier's files (or not heard from yet), or, with a kvstore up, a worker whose
    host-tier attach it has not answered: a request now would compute what the
    kvstore's tiers hold."""
    stores = [link for link in kvstores if link.up]
    waiting = [link.label for link in stores if not _disk_ready(link.stats)]
    if stores:
        waiting += [link.label for link in workers
                    if link.up and not _attach_settled(link.stats)]  # fmt: skip
    return waiting


def pool_totals(links: Iterable[Link]) -> dict[str, int]:
    """The workers' pool gauges summed (`radixserve.metrics.POOL_GAUGES`), each over the
    workers that report it."""
    totals: dict[str, int] = {}
    for link in links:
        engine = link.stats.engine if link.stats is not None else None
        if engine is None:
            continue
        for key, value in (
            ("pages_total", engine.pages_total), ("pages_used", engine.pages_used),
            ("pages_free", engine.pages_free), ("pages_locked", engine.pages_locked),
            ("pages_evictable", engine.pages_evictable), ("live_requests", engine.live_requests),
        ):  # fmt: skip
            if value is not None:
                totals[key] = totals.get(key, 0) + value
    return totals


def worker_view(link: Link, role: str, router: DecodeRouter | None = None) -> WorkerView:
    """``link``'s worker (of ``role`` unless it said its own); ``router``: the decode
    router whose requests in flight and view of its pages it shows."""
    return WorkerView(
        role=link.role or role,
        up=link.up,
        address=link.address,
        generation=link.generation,
        discovered=link.discovered,
        tp_size=link.ack.tp_size if link.ack is not None else 0,
        model_identity=identity_of(link.ack, link.refused),
        load=link.load if link.up else None,
        stats=link.stats if link.up else None,
        gateway_in_flight=router.in_flight.get(link.name, 0) if router is not None else None,
        routing_view_pages=router.known_pages(link.name) if router is not None else None,
    )


_TREE_TIMEOUT_S = 2.0  # a worker's answer to the explorer (one engine call between steps)


class WorkerQuestions:
    """The gateway's questions to its workers (the explorer's cache tree, the audit's
    all-clear), each answered by the reply that carries its id (`answered`)."""

    def __init__(self) -> None:
        self._trees: Replies[CacheTreeReply] = Replies()
        self._audit_clears: Replies[CacheAuditCleared] = Replies()

    async def cache_tree(
        self, link: Link, max_nodes: int, text_tokens: int
    ) -> CacheTreeReply | None:
        query_id = uuid.uuid4().hex
        query = CacheTreeQuery(query_id, max_nodes, text_tokens)
        return await self._trees.ask(link, query, query_id, _TREE_TIMEOUT_S)

    async def clear_cache_audit(self, links: list[Link]) -> dict[str, bool | None]:
        """`CacheAuditClear` to each of ``links``, answered in parallel."""

        async def clear(link: Link) -> bool | None:
            query_id = uuid.uuid4().hex
            reply = await self._audit_clears.ask(
                link, CacheAuditClear(query_id), query_id, _TREE_TIMEOUT_S
            )
            return None if reply is None else reply.was_failed

        answers = await asyncio.gather(*(clear(link) for link in links))
        return {link.label: answer for link, answer in zip(links, answers, strict=True)}

    def answered(self, msg: Message) -> bool:
        """Whether ``msg`` answers one of the questions; it is then handed over."""
        if isinstance(msg, CacheTreeReply):
            self._trees.answer(msg.query_id, msg)
        elif isinstance(msg, CacheAuditCleared):
            self._audit_clears.answer(msg.query_id, msg)
        else:
            return False
        return True
