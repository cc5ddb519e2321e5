"""The gateway's `EngineClient` for a disaggregated cluster: decode workers over ZMQ.

The gateway tokenises, hashes the prompt's pages once, picks a decode worker with them
(`DecodeRouter`: longest cached prefix, then load) and sends it a `GenerateRequest`
carrying the hashes: its one decision; the decode worker decides everything else. It
streams `TokenChunk`s back as `RequestOutput`s. Prefill workers are linked only to show
their load and counters (/debug/cache, /metrics). Workers are the static
``decode_workers`` / ``prefill_workers`` plus the kvstore's members
(`radixserve.runtime.membership`).

Failure contract: no decode worker up -> `UnavailableError` (503) at once;
`RequestFailed` -> `InvalidRequestError` / `CapacityError` (400) for the request's own
faults, else `UnavailableError`; a worker that drains or goes down -> the request
continues on another (`radixserve.runtime.routing.migration`); a caller that closes
the stream early -> `Abort` to the decode worker.

A stream's queue is filled by its link's reader, which never waits (one socket serves
every request on the worker): it is drained as fast as it fills by the gateway's pump
(its `Generation`), which bounds what a request holds for a slow HTTP client and
aborts the request past that bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, Protocol

import zmq.asyncio
from pydantic import SecretStr

from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.outputs import RequestOutput
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import share_fields, to_output, to_spec
from radixserve.errors import UnavailableError, UnknownAdapterError
from radixserve.model.identity import ModelIdentity
from radixserve.model.tokenizer import Tokenizer
from radixserve.protocol import GenerateRequest
from radixserve.protocol.security import keys_from
from radixserve.runtime.calls import Tasks
from radixserve.runtime.engine_client import EngineClient
from radixserve.runtime.links import Link, LinkIdentity, LinkSet
from radixserve.runtime.membership import MemberView
from radixserve.runtime.page_geometry import LearnedGeometry, PageGeometry
from radixserve.runtime.routing.adapter_views import AdapterViews
from radixserve.runtime.routing.cluster_links import ClusterLinks
from radixserve.runtime.routing.cluster_operations import ClusterOperations
from radixserve.runtime.routing.migration import (
    Route,
    Stream,
    WorkerLost,
    migrating,
    wait_for_worker,
)
from radixserve.runtime.routing.router import DecodeRouter
from radixserve.runtime.routing.worker_views import WorkerQuestions, kvstore_waiting
from radixserve.tracing import NO_SPAN, Span

_MAX_VIEW_PAGES = 1 << 18  # per decode worker, in the gateway's routing view


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

    def kvstore_list(self) -> list[str]: ...


class ClusterClient(ClusterOperations, ClusterLinks, EngineClient):
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
        if not settings.decode_workers and not settings.kvstore_list():
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
        self._streams: dict[str, Stream] = {}
        self._context: zmq.asyncio.Context | None = None
        self.decodes: LinkSet | None = None
        self.prefills: LinkSet | None = None
        self.kvstore: LinkSet | None = None
        self.view: MemberView | None = None
        self.migrations = 0  # requests moved off a lost or drained decode worker
        self.questions = WorkerQuestions()  # the explorer's and the audit's
        self.loras = AdapterViews()  # the workers' LoRA adapters; run-time loads
        self._background = Tasks(self.name)

    # -- lifetime --------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        self._context = context = zmq.asyncio.Context()
        me = LinkIdentity(self.name, "gateway", self.generation, s.heartbeat_interval_s,
                          s.peer_timeout_s, keys_from(s.cluster_secret))  # fmt: skip
        self.decodes = LinkSet(context, list(s.decode_workers), me, on_message=self._from_decode,
                               on_up=self._decode_up, on_down=self._decode_down,
                               pages=self.pages, tokens=True)  # fmt: skip
        self.prefills = LinkSet(context, list(s.prefill_workers), me, on_message=self._from_prefill,
                                on_up=self._worker_up, on_down=self._prefill_down,
                                pages=self.pages)  # fmt: skip
        self.view = MemberView({"decode": self.decodes, "prefill": self.prefills})
        self.kvstore = LinkSet(context, s.kvstore_list(), me, on_message=self._from_kvstore,
                               on_up=self._kvstore_up, on_down=self._kvstore_down)  # fmt: skip
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
        waiting = kvstore_waiting(self.kvstore.links if self.kvstore else (),
                                  [link for ls in (self.decodes, self.prefills) if ls is not None
                                   for link in ls.links])  # fmt: skip
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
        adapter: str = "",
    ) -> AsyncIterator[RequestOutput]:
        """Serve the request, moving it to another decode worker if its worker is lost
        or drains (module notes); the caller sees one stream under ``request_id``.
        ``cache_scope``: whose KV it shares (its pages are hashed in that scope's
        namespace, here and on the workers); ``routing_key``: `DecodeRouter` affinity;
        ``share``: its tenant, priority and weight, for the workers' schedulers;
        ``adapter``: its LoRA adapter, served only by the decode workers that hold it
        (`AdapterViews`; `UnknownAdapterError` if none does)."""
        route = Route(cache_scope, routing_key, share)
        if adapter:
            info = self.loras.holders(self.decodes.ready() if self.decodes else [], adapter)
            if info is None:
                raise UnknownAdapterError(f"no decode worker serves LoRA adapter {adapter!r}",
                                          param="model")  # fmt: skip
            route = Route(cache_scope, routing_key, share, adapter, info.fingerprint,
                          info.hash_namespace)  # fmt: skip
        # the request's one hashing, carried on (none before the namespace is known)
        hashes = (
            self.router.hashes(prompt_ids, cache_scope, route.namespace)
            if self.root_namespace is not None
            else []
        )

        def attempt(
            rid: str, p: SamplingParams, tried: set[str], resume: tuple[int, ...], wait: bool
        ) -> AsyncGenerator[RequestOutput, None]:
            return self._generate_on(prompt_ids, hashes, p, rid, tried, resume, wait, span, route)

        outputs = migrating(attempt, params, request_id, self.settings.max_migrations,
                            self._moved)  # fmt: skip
        async with contextlib.aclosing(outputs):  # type: ignore[type-var]
            async for output in outputs:
                yield output

    def _moved(self) -> None:
        self.migrations += 1

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
        route: Route | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Serve the request on the best decode worker not in ``tried`` (added to it),
        after the ``resume`` tokens already streamed; with ``wait``, wait up to
        ``migration_wait_s`` for one to be up. ``span``: the request's at the gateway,
        whose ``gateway.queue`` child runs from its arrival (this attempt's start, for a
        later attempt) until the request is sent, and which keeps the spans the decode
        worker carries back on the last chunk. ``route``: the request's cache scope and
        affinity key."""
        route = route or Route()
        retry = bool(resume or tried or wait)
        queued = span.child("gateway.queue", start_ns=None if retry else span.start_ns)
        pick = functools.partial(self._pick_decode, hashes, tried, route.key, route)
        link = await wait_for_worker(pick, self.settings.migration_wait_s) if wait else pick()
        tried.add(link.name)
        # counted before any await, so requests arriving together see each other's load
        self.router.started(link.name, hashes)
        stream = Stream(link, asyncio.Queue(), list(prompt_ids))
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
                        adapter=route.adapter,
                        adapter_fingerprint=route.fingerprint,
                    )
                )
            except TimeoutError:
                queued.end("the decode worker did not take the request", decode_worker=link.label)
                raise WorkerLost(f"decode worker {link.label} does not take requests") from None
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
                                 if finished_ok else None, route.scope, route.namespace)  # fmt: skip
            if not done and link.up:
                self._background.spawn(self._abort(link, request_id))

    # -- routing ---------------------------------------------------------------------

    def _pick_decode(
        self, hashes: list[int], exclude: set[str], affinity: str = "", route: Route | None = None
    ) -> Link:
        """The decode worker for a request (`DecodeRouter.pick`) among those ready, not in
        ``exclude`` and serving the ``route``'s adapter as it was routed."""
        route = route or Route()
        ready = [link for link in self.decodes.ready()] if self.decodes else []
        ready = [link for link in ready if link.name not in exclude]
        if route.adapter:
            ready = [link for link in ready
                     if self.loras.holds(link, route.adapter, route.fingerprint)]  # fmt: skip
            if not ready:
                raise UnavailableError(f"no decode worker serving LoRA adapter "
                                       f"{route.adapter!r} is up; try again shortly")  # fmt: skip
        if not ready:
            raise UnavailableError("no decode worker is up; try again shortly")
        name = self.router.pick([link.name for link in ready], hashes, affinity)
        return next(link for link in ready if link.name == name)
