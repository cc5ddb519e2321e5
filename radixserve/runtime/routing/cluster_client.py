"""The gateway's `EngineClient` for a disaggregated cluster: decode workers over ZMQ.

The gateway tokenises, hashes the prompt's pages once, picks a decode worker with them
(`DecodeRouter`: longest cached prefix, then load) and sends it a `GenerateRequest`
carrying the hashes: its one decision; the decode worker decides everything else. It
streams `TokenChunk`s back as `RequestOutput`s. Prefill workers are linked only to show
their load and counters (/debug/cache, /metrics). Workers are the static
``decode_workers`` / ``prefill_workers`` plus the kvstore's members
(`radixserve.runtime.membership`).

Failure contract: no decode worker up -> `UnavailableError` (503) at once; a worker
that refuses because it is draining -> another one; `RequestFailed` ->
`InvalidRequestError` / `CapacityError` (400) for the request's own faults, else
`UnavailableError`; a worker that goes down, or drains past its grace -> each of its
streams **migrates** to another decode worker with the tokens already streamed
(``resume_token_ids``, waiting up to ``migration_wait_s``), at most ``max_migrations``
times, so the caller sees one uninterrupted stream (docs/architecture.md §13); a caller
that closes the stream early -> `Abort` to the decode worker.

A stream's queue is filled by its link's reader, which never waits (one socket serves
every request on the worker): it is drained as fast as it fills by the gateway's pump
(its `Generation`), which bounds what a request holds for a slow HTTP client and
aborts the request past that bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import zmq.asyncio
from pydantic import SecretStr

from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import share_fields, to_output, to_spec
from radixserve.errors import CapacityError, InvalidRequestError, UnavailableError
from radixserve.metrics import POOL_GAUGES
from radixserve.model.identity import ModelIdentity
from radixserve.model.tokenizer import Tokenizer
from radixserve.protocol import (
    Abort,
    GenerateRequest,
    MemberList,
    Message,
    RequestFailed,
    TokenChunk,
)
from radixserve.protocol.messages import (
    CacheAuditClear,
    CacheAuditCleared,
    CacheTreeQuery,
    CacheTreeReply,
    HelloAck,
)
from radixserve.protocol.security import keys_from
from radixserve.runtime.calls import Replies, Tasks, send_quietly
from radixserve.runtime.engine_client import EngineClient
from radixserve.runtime.links import (
    LearnedGeometry,
    Link,
    LinkIdentity,
    LinkSet,
    PageGeometry,
    peer_identity,
)
from radixserve.runtime.membership import MemberView
from radixserve.runtime.routing.router import DecodeRouter
from radixserve.tracing import NO_SPAN, Span

logger = logging.getLogger(__name__)

_MAX_VIEW_PAGES = 1 << 18  # per decode worker, in the gateway's routing view
_TREE_TIMEOUT_S = 2.0  # a worker's answer to the explorer (one engine call between steps)


@dataclass
class _Stream:
    link: Link
    out: asyncio.Queue  # TokenChunk | BaseException
    prompt_ids: list[int]
    output_ids: list[int] = field(default_factory=list)


class _Draining(UnavailableError):
    """The decode worker refused the request because it is draining (or drained past its
    grace while serving it): continue elsewhere."""


class _WorkerLost(UnavailableError):
    """The decode worker serving the request went down: continue elsewhere."""


_MAX_DRAINING_RETRIES = 8


class ClusterSettings(Protocol):
    """What `ClusterClient` reads of its settings (the gateway's `GatewaySettings`)."""

    decode_workers: list[str]
    prefill_workers: list[str]
    kvstore: str | None
    heartbeat_interval_s: float
    peer_timeout_s: float
    cluster_secret: SecretStr | None
    decode_load_weight: float
    max_migrations: int
    migration_wait_s: float


@dataclass(frozen=True)
class _Route:
    """What routes a request besides its prompt: its cache scope (the namespace its
    pages are hashed in, `cache_scope`), its affinity key (`DecodeRouter.pick`) and its
    place in the workers' schedules (`radixserve.engine.fair_share`)."""

    scope: str = ""
    key: str = ""
    share: TenantShare = DEFAULT_SHARE


def _identity_of(ack: HelloAck | None, refused: str) -> dict[str, Any] | None:
    """A worker's model identity for /debug/cache, with why it was refused, if it was."""
    if ack is None and not refused:
        return None
    identity = None
    with contextlib.suppress(ValueError):
        identity = peer_identity(ack) if ack is not None else None
    entry: dict[str, Any] = {**identity.to_dict(), "short": identity.short} if identity else {}
    return {**entry, "refused": refused} if refused else entry or None


def _failure(msg: RequestFailed) -> Exception:
    if msg.error_type == "draining":
        return _Draining(msg.message)
    if msg.error_type == "invalid_request":
        return InvalidRequestError(msg.message)
    if msg.error_type == "capacity":
        return CapacityError(msg.message)
    return UnavailableError(f"{msg.error_type}: {msg.message}")


class ClusterClient(EngineClient):
    """Serves through remote decode (and prefill) workers. Call `start` on the event loop."""

    def __init__(
        self,
        settings: ClusterSettings,
        tokenizer: Tokenizer,
        model_name: str,
        max_model_len: int,
        page_size: int,
        hash_namespace: bytes | None = None,
        served_name: str = "",
    ) -> None:
        """``max_model_len``: the model's context as the checkpoint says; the decode
        workers' own (`HelloAck`) bounds it once they are up. ``page_size``: the workers'
        page size. ``hash_namespace``: the page-hash namespace the workers must share;
        None (what `build_client` gives): learned from the first decode worker's
        `HelloAck` with its model identity (`LearnedGeometry`; the gateway loads no
        weights, so it cannot compute them), after which workers of another are refused."""
        if not settings.decode_workers and not settings.kvstore:
            raise ValueError(
                "a cluster client needs decode worker addresses or a kvstore to find them"
            )
        self.settings = settings
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._served_name = served_name or model_name
        self._max_model_len = max_model_len
        self.name = f"gateway-{os.getpid()}"
        self.generation = time.time_ns() // 10**6
        self.pages: PageGeometry | LearnedGeometry = (
            LearnedGeometry(page_size, self._learned)
            if hash_namespace is None
            else PageGeometry(page_size, hash_namespace)
        )
        self.router = DecodeRouter(
            page_size, hash_namespace or b"", settings.decode_load_weight, _MAX_VIEW_PAGES
        )
        self._streams: dict[str, _Stream] = {}
        self._context: zmq.asyncio.Context | None = None
        self.decodes: LinkSet | None = None
        self.prefills: LinkSet | None = None
        self.kvstore: LinkSet | None = None
        self.view: MemberView | None = None
        self.migrations = 0  # requests moved off a lost or drained decode worker
        self._trees: Replies[CacheTreeReply] = Replies()  # the explorer's questions
        self._audit_clears: Replies[CacheAuditCleared] = Replies()
        self._background = Tasks(self.name)

    # -- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self._context = context = zmq.asyncio.Context()
        me = LinkIdentity(self.name, "gateway", self.generation, s.heartbeat_interval_s,
                          s.peer_timeout_s, keys_from(s.cluster_secret))  # fmt: skip
        self.decodes = LinkSet(context, list(s.decode_workers), me, on_message=self._from_decode,
                               on_up=self._decode_up, on_down=self._decode_down,
                               pages=self.pages)  # fmt: skip
        self.prefills = LinkSet(context, list(s.prefill_workers), me, on_message=self._from_prefill,
                                on_down=self._prefill_down, pages=self.pages)  # fmt: skip
        self.view = MemberView({"decode": self.decodes, "prefill": self.prefills})
        self.kvstore = LinkSet(context, [s.kvstore] if s.kvstore else [], me,
                               on_message=self._from_kvstore, on_up=self._kvstore_up)  # fmt: skip
        for links in self._link_sets():
            links.start()

    async def shutdown(self) -> None:
        for stream in self._streams.values():
            stream.out.put_nowait(UnavailableError("the gateway is shutting down"))
        for links in self._link_sets():
            await links.close()
        await self._background.close()
        if self._context is not None:
            self._context.term()
            self._context = None

    def close(self) -> None:
        """Nothing to do off the loop: `shutdown` (run by the app) closes the sockets."""

    def _link_sets(self) -> list[LinkSet]:
        return [ls for ls in (self.decodes, self.prefills, self.kvstore) if ls is not None]

    def health(self) -> tuple[bool, dict[str, Any]]:
        up = self.decodes.ready() if self.decodes else []
        workers = {link.label: link.up for ls in self._link_sets() for link in ls.links}
        # a kvstore that is up but still adopting its disk tier's files (or not heard
        # from yet), or a worker it has not answered the host-tier attach of: a request
        # now would compute what the kvstore's tiers hold
        stores = [link for link in (self.kvstore.links if self.kvstore else ()) if link.up]
        waiting = [link.label for link in stores
                   if not link.stats or link.stats.get("disk_tier_ready") == 0]  # fmt: skip
        if stores:
            waiting += [link.label for ls in (self.decodes, self.prefills) if ls is not None
                        for link in ls.links
                        if link.up and (not link.stats  # no heartbeat yet
                                        or link.stats.get("host_attach_settled") == 0)]  # fmt: skip
        detail: dict[str, Any] = {"workers": workers}
        if waiting:
            detail["waiting_for_the_kvstore"] = waiting
        return bool(up) and not waiting, detail

    # -- the workers' pages ------------------------------------------------------------

    @property
    def root_namespace(self) -> bytes | None:
        """The page-hash namespace of the workers' model identity and cache salt, the
        root of every request's (`scoped_namespace(root_namespace, scope)`); None until
        the first decode worker said hello: requests are then routed by load, with no
        page hashes (the decode worker hashes them)."""
        return self.pages.hash_namespace

    @property
    def identity(self) -> ModelIdentity | None:
        """The workers' model identity (None: not known yet, or not stated)."""
        return self.pages.identity if isinstance(self.pages, LearnedGeometry) else None

    def _learned(self, namespace: bytes, identity: ModelIdentity | None) -> None:
        """The first worker's namespace: route by it. (No decode worker is up then, so
        the router holds no view of another namespace: each was forgotten when its
        worker went down.)"""
        self.router.namespace = namespace
        if self.prefills is not None:  # those up before are checked now
            self.prefills.recheck()

    def _forget_geometry(self) -> None:
        """No decode worker is up: the next one sets the namespace again."""
        if isinstance(self.pages, LearnedGeometry) and not (self.decodes and self.decodes.up()):
            self.pages.forget()

    # -- EngineClient ----------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self._model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    @property
    def cache_page_size(self) -> int:
        return self.router.page_size  # the workers' (they keep whole pages)

    @property
    def served_name(self) -> str:
        return self._served_name

    async def generate(  # type: ignore[override]
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        request_id: str,
        *,
        span: Span = NO_SPAN,
        cache_scope: str = "",
        routing_key: str = "",
        share: TenantShare = DEFAULT_SHARE,
    ) -> AsyncIterator[RequestOutput]:
        """Serve the request, moving it to another decode worker if its worker is lost
        or drains (module notes); the caller sees one stream under ``request_id``.
        ``cache_scope``: whose KV it shares (its pages are hashed in that scope's
        namespace, here and on the workers); ``routing_key``: `DecodeRouter` affinity;
        ``share``: its tenant, priority and weight, for the workers' schedulers."""
        # the request's one hashing, carried on (none before the namespace is known)
        hashes = (
            self.router.hashes(prompt_ids, cache_scope) if self.root_namespace is not None else []
        )
        route = _Route(cache_scope, routing_key, share)
        sent: list[int] = []  # tokens the caller has been given
        first: RequestOutput | None = None  # its first output: usage and TTFT stay its
        tried: set[str] = set()
        refusals = losses = 0
        while True:
            attempt = request_id if not refusals + losses else f"{request_id}~{refusals + losses}"
            resumed = params if not sent else dataclasses.replace(params, prompt_logprobs=None)
            outputs = self._generate_on(prompt_ids, hashes, resumed, attempt, tried,
                                        tuple(sent), wait=bool(losses), span=span,
                                        route=route)  # fmt: skip
            streamed_before = len(sent)
            try:
                async with contextlib.aclosing(outputs):  # closing us aborts the request now
                    async for output in outputs:
                        first = first or output
                        sent.extend(output.new_token_ids)
                        yield self._as_first(output, request_id, first)
                return
            except (_Draining, _WorkerLost) as exc:
                # lost: the worker went away, or drained past its grace after streaming in
                # this attempt; a refusal before any token of it is no loss
                lost = isinstance(exc, _WorkerLost) or len(sent) > streamed_before
                losses, refusals = losses + lost, refusals + (not lost)
                if (
                    (sent and params.n > 1)
                    or losses > self.settings.max_migrations
                    or (refusals > _MAX_DRAINING_RETRIES)
                ):
                    raise UnavailableError(str(exc)) from None
                if lost:
                    tried.clear()  # any worker that is up, the lost one's restart included
                    self.migrations += 1
                logger.warning("%s: %s; continuing on another decode worker after %d tokens",
                               request_id, exc, len(sent))  # fmt: skip

    @staticmethod
    def _as_first(output: RequestOutput, request_id: str, first: RequestOutput) -> RequestOutput:
        """An output of a moved (or refused and resent) request as the caller knows it: its
        id, and the first attempt's prompt accounting and TTFT."""
        if output is first:
            return dataclasses.replace(output, request_id=request_id)
        return dataclasses.replace(
            output,
            request_id=request_id,
            cached_tokens=first.cached_tokens,
            host_cached_tokens=first.host_cached_tokens,
            disk_cached_tokens=first.disk_cached_tokens,
            ttft_ms=first.ttft_ms,
        )

    async def _generate_on(
        self,
        prompt_ids: list[int],
        hashes: list[int],
        params: SamplingParams,
        request_id: str,
        tried: set[str],
        resume: tuple[int, ...] = (),
        wait: bool = False,
        span: Span = NO_SPAN,
        route: _Route | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Serve the request on the best decode worker not in ``tried`` (added to it),
        after the ``resume`` tokens already streamed; with ``wait``, wait up to
        ``migration_wait_s`` for one to be up. ``span``: the request's at the gateway,
        whose ``gateway.queue`` child runs from its arrival (this attempt's start, for a
        later attempt) until the request is sent, and which keeps the spans the decode
        worker carries back on the last chunk. ``route``: the request's cache scope and
        affinity key."""
        route = route or _Route()
        retry = bool(resume or tried or wait)
        queued = span.child("gateway.queue", start_ns=None if retry else span.start_ns)
        link = await self._wait_for_decode(hashes, tried, route.key) if wait else None
        link = link or self._pick_decode(hashes, tried, route.key)
        tried.add(link.name)
        # counted before any await, so requests arriving together see each other's load
        self.router.started(link.name, hashes)
        stream = _Stream(link, asyncio.Queue(), list(prompt_ids))
        self._streams[request_id] = stream
        done = False
        try:
            try:
                await link.send(
                    GenerateRequest(
                        request_id=request_id,
                        prompt_token_ids=tuple(prompt_ids),
                        sampling=to_spec(params),
                        page_hashes=tuple(hashes),
                        resume_token_ids=resume,
                        traceparent=span.traceparent(),
                        cache_scope=route.scope,
                        **share_fields(route.share),
                    )
                )
            except TimeoutError:
                queued.end("the decode worker did not take the request", decode_worker=link.label)
                raise _WorkerLost(f"decode worker {link.label} does not take requests") from None
            queued.end(decode_worker=link.label, prompt_tokens=len(prompt_ids),
                       resumed_tokens=len(resume))  # fmt: skip
            while True:
                item = await stream.out.get()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                stream.output_ids.extend(item.token_ids)
                output = to_output(item)
                if item.finished:
                    done = True
                    span.adopt(item.spans)
                    output = dataclasses.replace(output, decode_worker=link.label)
                yield output
                if done:
                    return
        finally:
            self._streams.pop(request_id, None)
            finished_ok = done and bool(stream.output_ids) and self.root_namespace is not None
            self.router.finished(link.name, hashes, stream.prompt_ids + stream.output_ids
                                 if finished_ok else None, route.scope)  # fmt: skip
            if not done and link.up:
                self._background.spawn(self._abort(link, request_id))

    def stats(self) -> dict[str, int]:
        totals: dict[str, int] = {
            "gateway_migrations": self.migrations,
            "gateway_prompt_hashes": self.router.num_hashed,
        }
        if self.decodes is None or self.prefills is None:
            return totals
        for link in self.decodes.up() + self.prefills.up():
            for key in POOL_GAUGES:
                if key in link.stats:
                    totals[key] = totals.get(key, 0) + int(link.stats[key])
        return totals

    def worker_stats(self) -> dict[str, dict[str, Any]]:
        workers: dict[str, dict[str, Any]] = {}
        roles = {
            id(self.decodes): "decode",
            id(self.prefills): "prefill",
            id(self.kvstore): "kvstore",
        }
        for links in self._link_sets():
            for link in links.links:
                entry: dict[str, Any] = {
                    "role": link.role or roles[id(links)],
                    "address": link.address,
                    "up": link.up,
                    "generation": link.generation,
                    "discovered": link.discovered,
                    "tp_size": link.ack.tp_size if link.ack is not None else 0,
                    "model_identity": _identity_of(link.ack, link.refused),
                }
                if link.up:
                    entry.update(link.stats)
                    entry.update(dataclasses.asdict(link.load))
                if links is self.decodes:
                    entry["gateway_in_flight"] = self.router.in_flight.get(link.name, 0)
                    entry["routing_view_pages"] = self.router.known_pages(link.name)
                workers[link.label] = entry
        return workers

    async def cache_tree(
        self, worker: str, max_nodes: int, text_tokens: int
    ) -> CacheTreeReply | None:
        link = next((link for link in self._workers_up() if link.label == worker), None)
        if link is None:
            return None
        query_id = uuid.uuid4().hex
        query = CacheTreeQuery(query_id, max_nodes, text_tokens)
        return await self._trees.ask(link, query, query_id, _TREE_TIMEOUT_S)

    async def clear_cache_audit(self) -> dict[str, bool | None]:
        """`CacheAuditClear` to every worker up, answered in parallel."""
        links = self._workers_up()

        async def clear(link: Link) -> bool | None:
            query_id = uuid.uuid4().hex
            reply = await self._audit_clears.ask(
                link, CacheAuditClear(query_id), query_id, _TREE_TIMEOUT_S
            )
            return None if reply is None else reply.was_failed

        answers = await asyncio.gather(*(clear(link) for link in links))
        return {link.label: answer for link, answer in zip(links, answers, strict=True)}

    # -- routing ---------------------------------------------------------------------

    async def _wait_for_decode(
        self, hashes: list[int], exclude: set[str], affinity: str = ""
    ) -> Link | None:
        """The best ready decode worker not in ``exclude``, waiting up to
        ``migration_wait_s`` for one; None if none came."""
        deadline = time.monotonic() + self.settings.migration_wait_s
        while True:
            with contextlib.suppress(UnavailableError):
                return self._pick_decode(hashes, exclude, affinity)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)

    def _pick_decode(self, hashes: list[int], exclude: set[str], affinity: str = "") -> Link:
        ready = [link for link in self.decodes.ready()] if self.decodes else []
        ready = [link for link in ready if link.name not in exclude]
        if not ready:
            raise UnavailableError("no decode worker is up; try again shortly")
        name = self.router.pick([link.name for link in ready], hashes, affinity)
        return next(link for link in ready if link.name == name)

    def _kvstore_up(self, link: Link) -> None:
        if self.view is not None:
            self._background.spawn(send_quietly(link, self.view.watch()))

    def _from_kvstore(self, link: Link, msg: Message) -> None:
        if isinstance(msg, MemberList):
            if self.view is not None:
                self.view.apply(msg)
        else:
            self._unexpected(link, msg)

    # -- from the workers ------------------------------------------------------------

    def _workers_up(self) -> list[Link]:
        """The decode and prefill workers' links that are up."""
        pools = (self.decodes, self.prefills)
        return [link for pool in pools if pool is not None for link in pool.up()]

    def _answered(self, msg: Message) -> bool:
        """Whether ``msg`` answers one of the gateway's questions to any worker (the
        explorer's cache tree, the audit's clear); it is then handed over."""
        if isinstance(msg, CacheTreeReply):
            self._trees.answer(msg.query_id, msg)
        elif isinstance(msg, CacheAuditCleared):
            self._audit_clears.answer(msg.query_id, msg)
        else:
            return False
        return True

    def _from_prefill(self, link: Link, msg: Message) -> None:
        if not self._answered(msg):
            self._unexpected(link, msg)

    def _from_decode(self, link: Link, msg: Message) -> None:
        if self._answered(msg):
            return
        rid = getattr(msg, "request_id", "")
        stream = self._streams.get(rid)
        if stream is None or stream.link is not link:
            if isinstance(msg, TokenChunk) and not msg.finished:
                self._background.spawn(self._abort(link, rid))  # one we no longer wait for
            return
        if isinstance(msg, TokenChunk):
            stream.out.put_nowait(msg)
        elif isinstance(msg, RequestFailed):
            stream.out.put_nowait(_failure(msg))
        else:
            self._unexpected(link, msg)

    def _decode_up(self, link: Link) -> None:
        ack = link.ack
        if ack is None:
            return
        if isinstance(self.pages, LearnedGeometry):  # its restart may have unset it
            self.pages.learn(ack)
        if ack.model_name != self._model_name:
            logger.error("decode worker %s serves %r, the gateway %r", link.label,
                         ack.model_name, self._model_name)  # fmt: skip
        if ack.max_model_len:
            self._max_model_len = min(self._max_model_len, ack.max_model_len)

    def _decode_down(self, link: Link, why: str) -> None:
        self.router.forget(link.name)
        self._forget_geometry()
        for stream in self._streams.values():
            if stream.link is link:
                stream.out.put_nowait(_WorkerLost(f"decode worker {link.label} {why}"))
        if self.view is not None:
            self.view.link_down("decode", link)

    def _prefill_down(self, link: Link, why: str) -> None:
        if self.view is not None:
            self.view.link_down("prefill", link)

    def _unexpected(self, link: Link, msg: Message) -> None:
        logger.warning("unexpected %s from %s", msg.TYPE_TAG, link.label)

    @staticmethod
    async def _abort(link: Link, request_id: str) -> None:
        await send_quietly(link, Abort(request_id), timeout_ms=500)
