"""The decode worker: continuous batching over its own radix cache, remote prefill on demand.

Each `GenerateRequest` from the gateway is admitted once (`Worker.admit`, one engine
operation; nothing before it waits for a step) on one of three routes: **local** when at
most ``local_prefill_max_tokens`` of the prompt are uncached here or no prefill worker is
up; **host tier** when the kvstore's host tier supplies enough of the prefix first;
**remote** otherwise: the engine reserves pages for the uncached part, `PrefillRouter`
picks the prefill worker (the kvstore's index is asked only when more than one is
ready), which answers `KVReady`; this worker pulls those pages, sends `TransferDone` and
continues from the first token(s) (`Engine.activate_remote`). Outputs stream to the
gateway as `TokenChunk`s: on the token endpoint, sent by the engine thread itself, when
the gateway is connected to it (`radixserve.runtime.token_endpoint`), else on the control
socket. The gateway only chose this worker: every other decision of the request is made
here, once.

A remote prefill that fails, dies, times out (``prefill_timeout_s``) or whose transfer
fails returns the reserved pages uncached and, with ``on_transfer_failure="recompute"``,
is prefilled here (``"fail"``: `RequestFailed`); a prefill worker that refuses because it
is draining is no failure, the next one is tried. While draining this worker refuses new
`GenerateRequest`s and leaves once its running requests have finished. The request's
whole path and its failures: docs/architecture.md §8.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import zmq

from radixserve.engine.admission import Admission
from radixserve.engine.async_engine import AsyncEngine, OutputQueue, Sink
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import share_fields, to_chunk, to_logprob, to_params, to_share, to_spec
from radixserve.protocol import (
    Abort,
    GenerateRequest,
    HelloAck,
    IndexReply,
    KVReady,
    Message,
    PrefillRequest,
    RequestFailed,
    TransferDone,
)
from radixserve.protocol.fields import ErrorType
from radixserve.protocol.peer_messages import PeerPages
from radixserve.protocol.stats_messages import DecodeSection, ServiceStats, fill
from radixserve.runtime.calls import send_quietly
from radixserve.runtime.links import Link, LinkSet
from radixserve.runtime.service import Handlers, Peer, cannot_listen, dispatch
from radixserve.runtime.token_endpoint import TokenEndpoint, TokenRoute, token_routing_id
from radixserve.runtime.worker import Worker, WorkerInbound
from radixserve.runtime.worker_kvstore import WorkerFromKVStore
from radixserve.services.decode.prefill_router import PrefillRouter
from radixserve.services.decode.settings import DecodeSettings
from radixserve.tracing import NO_SPAN, Span
from radixserve.transfer import TransferError
from radixserve.transfer.network import url_host

logger = logging.getLogger(__name__)


class PrefillFailed(Exception):
    """Remote prefill of one request did not deliver KV."""

    def __init__(self, kind: ErrorType, message: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Adapter(NamedTuple):
    """A request's LoRA adapter here: its name ("" = the base model) and the fingerprint of
    the adapter this worker serves under that name."""

    name: str = ""
    fingerprint: str = ""


@dataclass
class _Pending:
    link: Link
    ready: asyncio.Future  # -> KVReady


#: what the decode worker's peers send it: gateways' requests, an operator's cache queries
DecodeInbound = WorkerInbound | GenerateRequest | Abort
#: what the kvstore sends it: a worker's messages, and the answers to its index queries
DecodeFromKVStore = WorkerFromKVStore | IndexReply
#: what prefill workers answer its `PrefillRequest`s and its reads of their pages
DecodeFromPrefill = KVReady | RequestFailed | PeerPages


class DecodeWorker(Worker):
    role = "decode"
    refused_while_draining = (GenerateRequest,)
    settings: DecodeSettings

    def __init__(self, settings: DecodeSettings, engine: AsyncEngine) -> None:
        super().__init__(settings, engine)
        self.prefills: LinkSet | None = None
        self.router = PrefillRouter(self.page_size, settings)
        self.transfer_seconds = 0.0  # spent reading prefill workers' pages
        self._pending: dict[str, _Pending] = {}
        self.prefill_handlers: Handlers = {KVReady: self._kv_ready, PeerPages: self._from_peer,
                                           RequestFailed: self._prefill_failed}  # fmt: skip
        self._owner: dict[str, bytes] = {}  # request id -> identity of the gateway
        # request id -> how its prompt got its KV: (route, prefill worker), sent on its last chunk
        self._routes: dict[str, tuple[str, str]] = {}
        self.tokens: TokenEndpoint | None = None  # with ``token_port``
        self._token_routes: dict[str, TokenRoute] = {}  # request id -> its way to its gateway

    async def start(self) -> None:
        assert self.context is not None
        s = self.settings
        if s.token_endpoint:
            address = f"tcp://{url_host(s.host)}:{s.token_port}"
            try:
                self.tokens = TokenEndpoint(self.context, address, self.keys)
            except zmq.ZMQError as exc:
                raise cannot_listen(
                    self.role, "token endpoint", address, exc, "TOKEN_PORT"
                ) from exc
        self.prefills = LinkSet(
            self.context,
            list(self.settings.prefill_workers),
            self.identity(),
            on_message=self._from_prefill,
            on_down=self._prefill_down,
            pages=self.peer_geometry(),
        )
        self.peer_links.sets["prefill"] = self.prefills
        await super().start()  # the kvstore link: membership starts arriving
        self.prefills.start()

    async def stop(self) -> None:
        if self.prefills is not None:
            await self.prefills.close()
        await super().stop()
        if self.tokens is not None:
            self.tokens.close()

    def hello_ack(self) -> HelloAck:
        ack = super().hello_ack()
        return dataclasses.replace(ack, token_port=self.tokens.port) if self.tokens else ack

    def describe(self) -> str:
        tokens = f", tokens on port {self.tokens.port}" if self.tokens else ""
        return super().describe() + tokens

    # -- the way back to the gateway ---------------------------------------------------

    def _token_route(self, peer: Peer) -> TokenRoute | None:
        """The token endpoint's way to ``peer``, if it is a gateway that said hello."""
        if self.tokens is None or peer.role != "gateway" or peer.generation < 0:
            return None
        return TokenRoute(self.tokens, token_routing_id(peer.name, peer.generation), to_chunk)

    async def admit(
        self, request_id: str, *args: Any, **kwargs: Any
    ) -> tuple[Admission, OutputQueue]:
        """`Worker.admit`, the request's outputs but its last sent by the engine thread on
        its token route, if it has one."""
        route = self._token_routes.get(request_id)
        sink: Sink | None = route.deliver if route is not None else None
        return await super().admit(request_id, *args, sink=sink, **kwargs)

    async def reply(self, peer: Peer, request_id: str, msg: Message) -> None:
        """On the request's token route while it works (in order after the engine thread's
        sends), else on the control socket."""
        route = self._token_routes.get(request_id)
        if route is None or not route.send(msg):
            await self.send_to(peer, msg)

    # -- from the gateway ------------------------------------------------------------

    def handlers(self) -> Handlers:
        return {**super().handlers(), GenerateRequest: self._generate, Abort: self._abort}

    def _generate(self, peer: Peer, msg: GenerateRequest) -> None:
        self._owner[msg.request_id] = peer.identity
        self.spawn(msg.request_id, self._serve(peer, msg))

    def _abort(self, _peer: Peer, msg: Abort) -> None:
        self.cancel(msg.request_id)

    def on_peer_lost(self, peer: Peer) -> None:
        for request_id, identity in list(self._owner.items()):
            if identity == peer.identity:
                self.cancel(request_id)

    def queued_tokens(self) -> int:
        return self.engine.stats().queued_prompt_tokens

    def stats(self) -> ServiceStats:
        decode = fill(
            DecodeSection, self.counters,
            prefills_up=len(self.prefills.ready()) if self.prefills else 0,
            awaiting_kv=len(self._pending),
            kv_transfer_seconds_total=self.transfer_seconds,
            token_endpoint_messages_total=self.tokens.sent if self.tokens else 0,
        )  # fmt: skip
        return dataclasses.replace(super().stats(), decode=decode)

    async def _serve(self, peer: Peer, msg: GenerateRequest) -> None:
        rid = msg.request_id
        request = self.tracer.join(msg.traceparent)  # the gateway's span of the request
        streaming = NO_SPAN
        route = self._token_route(peer)
        if route is not None:
            self._token_routes[rid] = route
        try:
            params = to_params(msg.sampling)
            ids, resume = list(msg.prompt_token_ids), list(msg.resume_token_ids)
            scope = msg.cache_scope  # whose KV it may share; the hashes are in its namespace
            share = to_share(msg)  # its place among other tenants' requests
            adapter = _Adapter(msg.adapter, self.loras.fingerprint(msg.adapter))
            # the gateway's hashes are in its adapter's namespace: ours if the same content
            carried = msg.page_hashes if msg.adapter_fingerprint == adapter.fingerprint else ()
            hashes = self.page_hashes(ids + resume, carried, scope, adapter.name)
            if resume:  # a migrated stream: computed here, after what it already streamed
                self.counters["resumed_requests_total"] += 1
                admitting = request.child("decode.admission", prompt_tokens=len(ids),
                                          resumed_tokens=len(resume))  # fmt: skip
                admission, out = await self.admit(rid, ids, params, hashes=hashes, resume=resume,
                                                  cache_scope=scope, share=share,
                                                  adapter=adapter.name, under=admitting)  # fmt: skip
                admitting.end(route=admission.route, cached_tokens=admission.cached_tokens)
                self._routes[rid] = (admission.route, "")
            else:
                out = await self._begin(rid, ids, params, hashes, request, scope, share, adapter)
            streaming = request.child("decode.stream")
            async for output in self.engine.outputs(rid, out):
                chunk = to_chunk(output)
                if output.finished:
                    how, prefill = self._routes.get(rid, ("local", ""))
                    streaming.end(completion_tokens=output.completion_tokens)
                    chunk = dataclasses.replace(chunk, route=how, prefill_worker=prefill,
                                                spans=request.records())  # fmt: skip
                await self.reply(peer, rid, chunk)
        except PrefillFailed as exc:
            await self.reply(peer, rid, RequestFailed(rid, exc.kind, str(exc)[:4096]))
        except asyncio.CancelledError:
            if self.draining:  # the drain grace is over: the gateway continues it elsewhere
                with contextlib.suppress(Exception):
                    failed = RequestFailed(rid, "draining", "drain grace is over")
                    await self.reply(peer, rid, failed)
            raise
        except Exception as exc:
            await self.fail(peer, rid, exc)
        finally:
            streaming.end("ended before its last token")  # exported, not carried back
            self._owner.pop(rid, None)
            self._routes.pop(rid, None)
            if route is not None:
                self.counters["token_fallbacks_total"] += int(route.fell_back)
                self._token_routes.pop(rid, None)

    async def _begin(
        self, rid: str, ids: list[int], params: SamplingParams, hashes: list[int], request: Span,
        scope: str = "", share: TenantShare = DEFAULT_SHARE, adapter: _Adapter | None = None,
    ) -> asyncio.Queue:  # fmt: skip
        """Admit the request once (`Worker.admit`: local, host tier, or remote when a
        prefill worker is ready and more than ``local_prefill_max_tokens`` would stay
        uncached), then, on the remote route, pick the prefill worker; its output queue.
        Spans under ``request``: ``decode.admission`` (a host-tier load under it), then
        ``decode.remote_prefill`` on the remote route. ``scope``: the request's cache scope,
        and ``share`` its tenant, priority and weight, here and on the prefill worker;
        ``adapter``: its LoRA adapter, which only prefill workers serving the same content
        compute (none: it is prefilled here)."""
        adapter = adapter or _Adapter()
        tried: frozenset[str] = frozenset()
        while True:
            ready = self._prefills_ready(tried, adapter)
            remote_over = self.settings.local_prefill_max_tokens if ready else None
            admitting = request.child("decode.admission", prompt_tokens=len(ids))
            admission, out = await self.admit(rid, ids, params, hashes=hashes, cache_scope=scope,
                                              share=share, remote_over=remote_over,
                                              adapter=adapter.name, under=admitting)  # fmt: skip
            admitting.end(route=admission.route, cached_tokens=admission.cached_tokens)
            if admission.route != "remote":
                self.counters["local_prefills_total"] += 1
                self._routes[rid] = (admission.route, "")
                return out
            link = await self._pick_prefill(hashes, tried, adapter)
            if link is None:  # none is ready any more: compute here
                await self.engine.abort_now(rid)
                self.counters["local_prefills_total"] += 1
                return (await self.admit(rid, ids, params, hashes=hashes, cache_scope=scope,
                                         share=share, adapter=adapter.name))[1]  # fmt: skip
            try:
                return await self._remote(link, rid, ids, params, admission, out, hashes, request,
                                          scope, share, adapter)  # fmt: skip
            except PrefillFailed as exc:
                if exc.kind != "draining":
                    raise
                tried |= {link.name}  # it began draining after it was picked: next one

    # -- remote prefill --------------------------------------------------------------

    def _prefills_ready(self, exclude: frozenset[str], adapter: _Adapter) -> list[Link]:
        """The prefill workers that may take the request: ready, not ``exclude``d, and
        serving its ``adapter`` with the same content as here."""
        if self.prefills is None:
            return []
        return self.router.ready(self.prefills.links, exclude, *adapter)

    async def _pick_prefill(
        self, hashes: Sequence[int], exclude: frozenset[str], adapter: _Adapter
    ) -> Link | None:
        """The prefill worker of least cost (`PrefillRouter`) among `_prefills_ready`; the
        kvstore's index of their caches is asked only when there is a choice."""
        ready = self._prefills_ready(exclude, adapter)
        cached, host = await self.index.lookup(hashes) if len(ready) > 1 else ({}, 0)
        return self.router.pick(ready, len(hashes), cached, host, exclude)

    async def _remote(
        self,
        link: Link,
        rid: str,
        ids: list[int],
        params: SamplingParams,
        admission: Admission,
        out: asyncio.Queue,
        hashes: list[int],
        request: Span = NO_SPAN,
        scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: _Adapter | None = None,
    ) -> asyncio.Queue:
        """Prefill on ``link``, pull the pages, activate (no wait: the first outputs go to
        ``out``); on failure recompute here or raise. Its span, ``decode.remote_prefill``
        under ``request``, is the parent of the prefill worker's spans (carried back on
        `KVReady`) and of ``prefill.transfer``, timed here where the pages are read. Pages
        computed with another LoRA adapter than the request's ``adapter`` (`KVReady`'s
        fingerprint) are not read: the prompt is recomputed here."""
        adapter = adapter or _Adapter()
        dst = list(admission.page_ids)
        pending = _Pending(link, asyncio.get_running_loop().create_future())
        self._pending[rid] = pending
        self.router.assign(link.name, len(ids))
        answered = consumed = False
        remote = request.child("decode.remote_prefill", prefill_worker=link.label,
                               prompt_tokens=len(ids), pages=len(dst))  # fmt: skip
        try:
            await link.send(
                PrefillRequest(
                    request_id=rid,
                    token_ids=tuple(ids),
                    dst_page_ids=tuple(dst),
                    sampling=to_spec(params),
                    num_cached_tokens=admission.cached_tokens,
                    traceparent=remote.traceparent(),
                    cache_scope=scope,
                    **share_fields(share),
                    page_hashes=tuple(hashes[: len(ids) // self.page_size]),
                    adapter=adapter.name,
                    adapter_fingerprint=adapter.fingerprint,
                )
            )
            kv: KVReady = await asyncio.wait_for(pending.ready, self.settings.prefill_timeout_s)
            self.router.answered(link.name, len(ids))
            answered = True
            if kv.adapter_fingerprint != adapter.fingerprint:  # never read another's pages
                raise TransferError(
                    f"{link.label} computed the pages with LoRA adapter fingerprint "
                    f"{kv.adapter_fingerprint or '(the base model)'!r}, the request's is "
                    f"{adapter.fingerprint or '(the base model)'!r}"
                )
            remote.adopt(kv.spans)
            transfer = remote.child("prefill.transfer", pages=len(dst),
                                    bytes=len(dst) * self.engine.info.geometry.page_bytes)  # fmt: skip
            try:
                await self._pull(link, kv, dst)
            except BaseException as exc:
                transfer.end(exc)
                raise
            transfer.end()
            consumed = True
            await send_quietly(link, TransferDone(rid))
            remote.end()
        except asyncio.CancelledError:
            remote.end("cancelled")
            await self._give_back(link, rid, consumed)
            raise
        except (PrefillFailed, TransferError, TimeoutError) as exc:
            remote.end(exc)
            await self._give_back(link, rid, consumed)
            if isinstance(exc, PrefillFailed) and exc.kind == "draining":
                raise  # not a failure: `_begin` tries the next prefill worker
            self.counters["remote_prefill_failures_total"] += 1
            if isinstance(exc, PrefillFailed) and exc.kind == "invalid_request":
                raise
            if self.settings.on_transfer_failure == "fail":
                kind: ErrorType = exc.kind if isinstance(exc, PrefillFailed) else "timeout"
                raise PrefillFailed(kind, f"remote prefill on {link.label} failed: {exc}") from exc
            logger.warning("%s: remote prefill of %s on %s failed (%s); recomputing locally",
                           self.name, rid, link.label, exc)  # fmt: skip
            self.counters["local_prefills_total"] += 1
            return (await self.admit(rid, ids, params, hashes=hashes, cache_scope=scope,
                                     share=share, adapter=adapter.name))[1]  # fmt: skip
        finally:
            self._pending.pop(rid, None)
            if not answered:
                self.router.answered(link.name, len(ids))
        self.counters["remote_prefills_total"] += 1
        self._routes[rid] = ("remote", link.name)
        first = list(kv.first_token_ids)
        first_lps = [to_logprob(e) for e in kv.first_logprobs]
        prompt_lps = None
        if params.prompt_logprobs is not None:
            prompt_lps = [to_logprob(e) for e in kv.prompt_logprobs]
        self.engine.activate_remote(rid, first, kv.cached, first_lps, prompt_lps)
        return out

    async def _pull(self, link: Link, kv: KVReady, dst: list[int]) -> None:
        """Read the prefill worker's pages into ``dst``; raise `TransferError` if not done."""
        agent = self.agent
        assert agent is not None and link.ack is not None
        if len(kv.src_page_ids) != len(dst):
            raise TransferError(f"KVReady names {len(kv.src_page_ids)} pages, expected {len(dst)}")
        if not dst:
            return
        timeout_s = self.settings.transfer_timeout_s
        if kv.lease_ms is not None:  # the pages are lent for this long from its sending
            timeout_s = min(timeout_s, kv.lease_ms / 1000)
            if timeout_s <= 0:
                raise TransferError("the prefill worker's lease on the pages ran out")
        agent.add_peer(link.name, link.generation, link.ack.transfer_metadata)
        start = time.perf_counter()
        handle = agent.read_pages(link.name, list(kv.src_page_ids), dst, timeout_s=timeout_s)
        if await agent.wait_async(handle) == "failed":
            raise TransferError(handle.error or "KV transfer failed")
        elapsed = time.perf_counter() - start
        self.counters["kv_transfers_total"] += 1
        self.counters["kv_transfer_pages_total"] += len(dst)
        self.counters["kv_transfer_bytes_total"] += len(dst) * self.engine.info.geometry.page_bytes
        self.transfer_seconds += elapsed

    async def _give_back(self, link: Link, rid: str, consumed: bool) -> None:
        """Free our reservation (uncached) and the prefill worker's lease or work."""
        await self.engine.abort_now(rid)
        # best effort: if the prefill worker is unreachable, its lease expires
        await send_quietly(link, TransferDone(rid) if consumed else Abort(rid))

    def _from_prefill(self, link: Link, msg: Message) -> None:
        if not dispatch(self.prefill_handlers, link, msg):
            logger.warning("%s: unexpected %s from %s", self.name, msg.TYPE_TAG, link.label)

    def _awaited(self, link: Link, rid: str) -> _Pending | None:
        """The remote prefill of ``rid`` while it still waits for ``link``'s answer."""
        pending = self._pending.get(rid)
        waits = pending is not None and pending.link is link and not pending.ready.done()
        return pending if waits else None

    def _kv_ready(self, link: Link, msg: KVReady) -> None:
        pending = self._awaited(link, msg.request_id)
        if pending is not None:
            pending.ready.set_result(msg)
        else:  # we gave up on it: let the lease go now
            self.spawn_notice(send_quietly(link, TransferDone(msg.request_id, ok=False)))

    def _prefill_failed(self, link: Link, msg: RequestFailed) -> None:
        if self.peer_reads is not None and self.peer_reads.answer(link, msg):
            return  # it refused to lend pages
        pending = self._awaited(link, msg.request_id)
        if pending is not None:
            pending.ready.set_exception(PrefillFailed(msg.error_type, msg.message))

    def _prefill_down(self, link: Link, why: str) -> None:
        for pending in self._pending.values():
            if pending.link is link and not pending.ready.done():
                pending.ready.set_exception(PrefillFailed("peer_lost", f"{link.label} {why}"))
        self.router.forget(link.name)
        self._peer_down("prefill", link)
