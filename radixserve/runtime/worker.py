"""What prefill and decode workers share: an engine and a KV transfer agent behind a service.

A worker is one process: an `Engine` stepping on its own thread (`AsyncEngine`), and the
service control plane (`radixserve.runtime.service`) on the main thread's asyncio loop,
which owns every socket and never waits on a step, so heartbeats and aborts flow while
a long prefill runs. Its `HelloAck` says what it serves (model, context, page geometry)
and carries its transfer agent's metadata.

With a kvstore (``kvstore``, or ``radixserve prefill|decode --join``) the worker is a
member of that cluster (`Register` when the link comes up and when it starts draining,
`Deregister` when the drain and its linger are done; `radixserve.runtime.membership`),
publishes its radix cache's events to the kvstore's index and asks it who holds what
(`radixserve.runtime.index_client`), reads prompt prefixes other workers hold and lends
its own (`radixserve.runtime.peer_reads`) and, if the kvstore has a host tier, spills
into it and loads from it (`radixserve.runtime.host_tier`); a prefix read from either is
one `PrefixLoad` to the admission. The whole story: docs/architecture.md §8-§10.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Sequence
from typing import Any

from radixserve.cache.block_hash import page_hashes, scoped_namespace
from radixserve.engine.admission import Admission
from radixserve.engine.async_engine import AsyncEngine, OutputQueue, Sink
from radixserve.engine.fair_share import DEFAULT_SHARE, TenantShare
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.tp_calls import StartAgent
from radixserve.errors import RequestError
from radixserve.protocol import (
    Deregister,
    HelloAck,
    Message,
    Register,
    RequestFailed,
    TransferDone,
    WorkerLoad,
)
from radixserve.protocol.lora_messages import LoraLoad, LoraUnload
from radixserve.protocol.peer_messages import PeerPages, PeerRead
from radixserve.protocol.stats_messages import (
    EngineSection,
    ServiceStats,
    fill,
)
from radixserve.protocol.view_messages import CacheAuditClear, CacheAuditCleared, CacheTreeQuery
from radixserve.runtime.adapters import adapter_infos
from radixserve.runtime.kv_events import KVEventPublisher
from radixserve.runtime.links import Link, LinkSet
from radixserve.runtime.membership import MemberView
from radixserve.runtime.network import transfer_network
from radixserve.runtime.page_geometry import PageGeometry
from radixserve.runtime.peer_reads import PageLending, PeerLinks, PeerReads, linger
from radixserve.runtime.service import Handlers, Peer, serve_until_signalled
from radixserve.runtime.settings import WorkerSettings, resolved_tp
from radixserve.runtime.worker_kvstore import KVStoreMember
from radixserve.runtime.worker_loras import WorkerLoras
from radixserve.tracing import NO_SPAN, Span, Tracer, otlp_exporter
from radixserve.transfer import create_agent
from radixserve.transfer.group import GroupAgent
from radixserve.vllm_metrics import HIT_TOKENS, QUERIED_TOKENS, engine_metrics
from radixserve.worker_metrics import service_metrics

logger = logging.getLogger(__name__)


#: what a worker's peers send it beside its role's requests: an operator's cache queries,
#: the gateway's run-time LoRA loads and unloads, other workers' reads of its pages
WorkerInbound = CacheTreeQuery | CacheAuditClear | LoraLoad | LoraUnload | PeerRead | TransferDone
#: what other workers answer its reads of their pages
WorkerFromPeer = PeerPages | RequestFailed
#: the roles whose pages a worker reads
PEER_ROLES = ("decode", "prefill")


class Worker(KVStoreMember):
    """A service with an engine and a transfer agent; subclasses handle request messages."""

    settings: WorkerSettings

    def __init__(self, settings: WorkerSettings, engine: AsyncEngine) -> None:
        super().__init__(settings, engine)
        self.kv_events: KVEventPublisher | None = None  # vLLM's format, when configured
        # records the spans of requests that carry a traceparent; exports them when the
        # OTEL_* environment names a collector
        self.tracer = Tracer(self.role, otlp_exporter(self.role))
        self.loras = WorkerLoras(self.name, engine, self.send_to, self.beat_now)
        self.lending = PageLending(engine)
        # links to the other workers by role (a subclass may put its own in first)
        self.peer_links = PeerLinks(self.name, {})

    async def start(self) -> None:
        s = self.settings
        info = self.engine.info
        self.loras.adopt((await self.engine.call(adapter_infos))[0])
        network = transfer_network(s)
        local = create_agent(s.transfer_backend, self.name, info.kv, info.geometry,
                             nixl_progress_thread=s.nixl_progress_thread, network=network,
                             shard=info.kv_shard)  # fmt: skip
        self.agent = GroupAgent(local, info.kv_shard.size)
        self.lending.agent = self.agent
        if info.kv_shard.size > 1:  # the other ranks' agents, which ours drives
            secret = s.cluster_secret.get_secret_value() if s.cluster_secret else None
            call = StartAgent(s.transfer_backend, self.name, self.agent.endpoint,
                              local.default_timeout_s, s.nixl_progress_thread, network.bind_host,
                              network.advertise_host, network.port_min, network.port_max, secret)  # fmt: skip
            await self.engine.call(lambda e: e.start_rank_agents(call))
            await asyncio.to_thread(self.agent.wait_ranks)
        if s.kv_events_endpoint is not None:
            self._start_kv_events()
        # another worker reads only the pages lent to it; the agent is driven while any are
        self.agent.enforce_grants()
        lending = self.lending
        self.run_in_background(self.agent.serve_reads_while(lending.lending_now, lending.lending))
        if not s.kvstore:
            return
        if s.peer_reads and info.prefix_cache:
            self._start_peer_reads()
        self.peer_links.watch(self.name)
        assert self.context is not None
        self.link_kvstores()

    def _start_kv_events(self) -> None:
        """Publish the radix cache's pages in vLLM's format (`radixserve.runtime.kv_events`)."""
        if not self.engine.info.prefix_cache:
            raise ValueError(
                f"RADIXSERVE_{self.role.upper()}_KV_EVENTS_ENDPOINT needs the prefix cache "
                "(RADIXSERVE_PREFIX_CACHE=true): without it no page is cached"
            )
        self.kv_events = KVEventPublisher(self.settings, self.page_size)
        self.engine.listen_blocks(self.kv_events.on_block)
        logger.info("%s: KV events on %s (replay: %s)", self.name, self.kv_events.endpoint,
                    self.kv_events.replay_endpoint)  # fmt: skip

    def peer_geometry(self) -> PageGeometry:
        """What another worker's pages must match for this one to read them."""
        info = self.engine.info
        return PageGeometry(info.page_size, info.hash_namespace, info.geometry.digest,
                            info.kv_shard.size, info.identity)  # fmt: skip

    def _start_peer_reads(self) -> None:
        """Links to the other workers (kept by the membership) and reads of their pages."""
        assert self.context is not None and self.agent is not None
        for role in PEER_ROLES:
            self.peer_links.add(role, functools.partial(self._peer_link_set, role))
        self.peer_reads = PeerReads(self.name, self.settings, self.engine, self.agent,
                                    self.peer_links.links)  # fmt: skip

    def _peer_link_set(self, role: str) -> LinkSet:
        assert self.context is not None
        return LinkSet(self.context, [], self.identity(), on_message=self._from_peer,
                       on_up=self._peer_up, on_down=functools.partial(self._peer_down, role),
                       pages=self.peer_geometry())  # fmt: skip

    def _from_peer(self, link: Link, msg: Message) -> None:
        if self.peer_reads is None or not isinstance(msg, WorkerFromPeer):
            logger.warning("%s: unexpected %s from %s", self.name, msg.TYPE_TAG, link.label)
        elif not self.peer_reads.answer(link, msg):
            logger.debug("%s: %s from %s answers nothing asked", self.name, msg.TYPE_TAG,
                         link.label)  # fmt: skip

    def _peer_up(self, link: Link) -> None:
        if self.peer_reads is not None:
            self.peer_reads.connect(link)

    def _peer_down(self, role: str, link: Link, _why: str = "") -> None:
        if self.peer_reads is not None:
            self.peer_reads.link_down(link)
        self.peer_links.link_down(role, link)

    async def stop(self) -> None:
        await self.peer_links.close()
        if self.peer_reads is not None:
            await self.peer_reads.close()
        if self.kv_events is not None:
            self.engine.listen_blocks(None)
            await asyncio.to_thread(self.kv_events.close)
        if self.kvstore is not None:
            await self.kvstore.close()
        if self.host is not None:
            await self.host.close()
        for remote in self.remote_hosts.values():
            await remote.close()
        self.engine.close()
        if self.agent is not None:
            self.agent.close()
        self.tracer.close()

    # -- membership -------------------------------------------------------------------

    def member_view(self) -> MemberView | None:
        return self.peer_links.view

    def on_drain(self) -> None:
        self.spawn_notice(self._to_kvstore(Register(self.member())))

    def busy(self) -> bool:
        """Requests running, or pages lent that a peer has yet to read."""
        return bool(self.tasks) or self.lending.lending_now()

    async def on_drained(self) -> None:
        if self.peer_reads is not None:
            await linger(self.name, self.settings, self.peer_links, self.lending)
        await self._to_kvstore(Deregister(self.name, self.generation), timeout_ms=1000)
        # sockets close with linger 0: give the message a moment on the wire (if it is
        # lost anyway, the kvstore drops us when our heartbeats stop)
        await asyncio.sleep(0.1)

    def describe(self) -> str:
        events = f", KV events on {self.kv_events.endpoint}" if self.kv_events else ""
        return f", KV transfer over {self.settings.transfer_backend}{events}"

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready once the engine is loaded and the transfer agent made (the service
        started), with the kvstore link up when there is a kvstore, and not draining."""
        ok, detail = super().health()
        ok = ok and self.agent is not None
        if self.kvstore is not None:  # ready while any kvstore is up: each keeps the members
            up = [link.up for link in self.kvstore.links]
            detail["kvstore"] = (
                "up" if all(up) else f"{sum(up)} of {len(up)} up" if any(up) else "down"
            )
            ok = ok and any(up)
        return ok, detail

    def hello_ack(self) -> HelloAck:
        info = self.engine.info
        assert self.agent is not None
        return HelloAck(
            name=self.name,
            role=self.role,
            generation=self.generation,
            model_name=info.model_name,
            max_model_len=info.max_model_len,
            page_size=info.page_size,
            hash_namespace=info.hash_namespace,
            pool_digest=info.geometry.digest,
            tp_size=info.kv_shard.size,
            transfer_metadata=self.agent.metadata(),
            model_identity=info.identity.key if info.identity is not None else "",
        )

    def handlers(self) -> Handlers:
        return {CacheTreeQuery: self._describe_cache, CacheAuditClear: self._clear_audit,
                LoraLoad: self.loras.load, LoraUnload: self.loras.unload,
                PeerRead: self._lend, TransferDone: self._transfer_done}  # fmt: skip

    # -- lending pages ------------------------------------------------------------------

    async def _lend(self, peer: Peer, msg: PeerRead) -> None:
        """Lend another worker the cached pages it asks for (`PageLending.lend`), if its
        adapter is this worker's (same content)."""
        try:
            if self.loras.fingerprint(msg.adapter) != msg.adapter_fingerprint:
                raise RequestError(f"{self.name} serves LoRA adapter {msg.adapter!r} with "
                                   "other content")  # fmt: skip
            lent = await self.lending.lend(
                peer.name, peer.identity, msg, self.settings.peer_lease_s
            )
            await self.send_to(peer, lent)
        except Exception as exc:
            self.lending.release(msg.read_id)
            await self.fail(peer, msg.read_id, exc)

    def _transfer_done(self, _peer: Peer, msg: TransferDone) -> None:
        if not msg.ok:
            logger.info("%s: a read of %s's pages failed on the reader", self.name, msg.request_id)
        self.release_lent(msg.request_id)

    def release_lent(self, lease_id: str) -> None:
        """A reader is done with (or gave up on) the pages lent under ``lease_id``."""
        self.lending.release(lease_id)

    def on_peer_lost(self, peer: Peer) -> None:
        self.lending.reader_lost(peer.identity)

    async def _describe_cache(self, peer: Peer, query: CacheTreeQuery) -> None:
        """Answer the gateway's `CacheTreeQuery` for its explorer: one engine call,
        between two steps."""
        reply, _ = await self.engine.call(
            lambda e: e.cache_view(query.query_id, query.max_nodes, query.text_tokens)
        )
        await self.send_to(peer, reply)

    async def _clear_audit(self, peer: Peer, msg: CacheAuditClear) -> None:
        """An operator's all-clear for the cache audit (`Engine.clear_audit`)."""
        was_failed, _ = await self.engine.call(lambda e: e.clear_audit())
        await self.send_to(peer, CacheAuditCleared(msg.query_id, was_failed))

    def page_hashes(
        self,
        token_ids: list[int],
        carried: Sequence[int] = (),
        cache_scope: str = "",
        adapter: str = "",
    ) -> list[int]:
        """The chained hashes of ``token_ids``' full pages in the namespace of
        ``cache_scope`` under LoRA ``adapter`` ("" = the base model): ``carried`` (the
        gateway's, of the prompt, in that same namespace) extended over what follows them
        (a resumed stream's tokens), or hashed here when nothing was carried (counted: a
        request is hashed once). An adapter not loaded here: nothing (its admission
        fails)."""
        size = self.page_size
        done = min(len(carried), len(token_ids) // size)
        if not done and len(token_ids) >= size:
            self.counters["prompt_hashes_total"] += 1
        parent = carried[done - 1] if done else None
        root = self.engine.info.hash_namespace
        if adapter:
            info = self.loras.served.get(adapter)
            if info is None:
                return []
            root = info.hash_namespace
        namespace = scoped_namespace(root, cache_scope)
        rest = page_hashes(token_ids[done * size :], size, namespace, parent)
        return [*carried[:done], *rest]

    async def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        hashes: Sequence[int] | None = None,
        remote_over: int | None = None,
        lease_s: float | None = None,
        resume: list[int] | None = None,
        cache_scope: str = "",
        share: TenantShare = DEFAULT_SHARE,
        adapter: str = "",
        under: Span = NO_SPAN,
        sink: Sink | None = None,
    ) -> tuple[Admission, OutputQueue]:
        """A request's one admission: a prefix past the device hit leased from a peer's
        cache or the host tier (kvstore round trips, only when a long part is missing on
        device: `PrefixSources.plan`), then one engine operation (`Engine.admit`); on the host
        route the read and `finish_host_admission` follow without waiting for a step. The
        admission and the queue of the request's outputs (its first one comes at the end
        of the next step on the local route). ``hashes``: the page hashes of
        ``prompt_ids`` + ``resume`` (`page_hashes`); ``resume``: a migrated stream's tokens
        so far (`Engine.admit`); ``cache_scope``: whose KV it may share (`Engine.admit`;
        ``hashes`` are in its namespace); ``share``: its tenant, priority and weight
        (`Engine.admit`); ``adapter``: its LoRA adapter (``hashes`` are in its namespace).
        ``under``: the span a load's span (``<role>.host_load`` or ``<role>.peer_read``:
        lookup and read) goes under. ``sink``: sends the request's outputs but its last on
        the engine thread (`AsyncEngine.admit`)."""
        resume = resume or []
        looked_up_ns = time.time_ns()
        load = None
        sources = self.sources
        if sources is not None and (sources.host is not None or sources.peer_reads is not None):
            known = prompt_ids + resume
            if hashes is None:
                hashes = self.page_hashes(known, (), cache_scope, adapter)
            load = await sources.plan(request_id, known, hashes, cache_scope, adapter,
                                           self.loras.fingerprint(adapter))  # fmt: skip
        loading, read_ok = NO_SPAN, False
        if load is not None:
            loading = under.child(f"{self.role}.{load.span}", start_ns=looked_up_ns,
                                  **load.attributes)  # fmt: skip
        try:
            admission, out = await self.engine.admit(
                request_id, prompt_ids, params, remote_over=remote_over,
                host=load.plan if load is not None else None, lease_s=lease_s, resume=resume,
                cache_scope=cache_scope, share=share, adapter=adapter, sink=sink,
            )  # fmt: skip
            self.counters[QUERIED_TOKENS] += len(prompt_ids) + len(resume)
            self.counters[HIT_TOKENS] += admission.cached_tokens
            if admission.route == "host":
                assert load is not None
                try:
                    read_ok = await load.read(admission.page_ids)
                except BaseException:  # cancelled mid-read: the read cannot land any more
                    self.engine.abort(request_id)
                    raise
                self.engine.finish_host_admission(request_id, read_ok, load.disk_pages,
                                                  peer=load.tier == "peer")  # fmt: skip
                loading.end(None if read_ok else "read failed", read=read_ok)
        finally:
            loading.end()  # not read: another route was chosen, or it was cancelled
            if load is not None:
                load.release(read_ok)
        return admission, out

    def load(self) -> WorkerLoad:
        stats = self.engine.stats()
        return WorkerLoad(
            queued_tokens=self.queued_tokens(),
            running=stats.running,
            waiting=stats.waiting,
            draining=self.draining,
        )

    def queued_tokens(self) -> int:
        """Hook: prompt tokens accepted and not computed yet (see `WorkerLoad`)."""
        return 0

    def stats(self) -> ServiceStats:
        """The service's numbers, its engine's (pool pages, live requests, audit, step
        counters, the prefix cache's use, the LoRA adapter slots) and its host tier's."""
        engine = self.engine.stats()
        section = fill(
            EngineSection, {**engine.cache, **engine.steps, **engine.lora, **self.counters},
            page_bytes=self.engine.info.geometry.page_bytes,
            # peers' reads of pages not lent to them (ZMQ)
            kv_transfer_refused_reads_total=self.agent.refused_reads if self.agent else None,
        )  # fmt: skip
        host = self.sources.host_stats() if self.sources is not None else None
        peer = self.peer_reads.stats(self.lending) if self.peer_reads is not None else None
        counts = engine.lora_counts
        loras = tuple(dataclasses.replace(info, loads=counts[info.name][0],
                                          evictions=counts[info.name][1])
                      if info.name in counts else info
                      for info in self.loras.served.values())  # fmt: skip
        return dataclasses.replace(super().stats(), engine=section, host_tier=host,
                                   peer_reads=peer, loras=loras)  # fmt: skip

    def metrics_text(self) -> bytes:
        """The service's own families, then vLLM's per-engine ones (`radixserve.vllm_metrics`;
        this worker is the engine, named by its name)."""
        load, stats = self.load(), self.stats()
        own = service_metrics(self.name, self.role, load, stats)
        assert stats.engine is not None
        return own + engine_metrics(self.engine.info.served_name, self.name, load, stats.engine)


def run_worker(worker_cls: type[Worker], settings: WorkerSettings) -> int:
    """Build the engine and serve ``worker_cls`` until SIGINT/SIGTERM; the process entry."""
    from radixserve.settings import EngineSettings

    from_env: dict[str, Any] = {}  # every field from RADIXSERVE_* / defaults
    # the worker's own audit (RADIXSERVE_DECODE_AUDIT_SAMPLE_RATE, ...), validated above
    own = {key: getattr(settings, key) for key in ("audit_sample_rate", "audit_fail_closed")
           if getattr(settings, key) is not None}  # fmt: skip
    if settings.tp is not None:  # the worker's own size (RADIXSERVE_PREFILL_TP, ..._DECODE_TP)
        own["tp"] = resolved_tp(settings.tp)
    engine_settings = EngineSettings(**from_env).model_copy(update=own)
    # built on the engine thread, where it steps
    worker = worker_cls(settings, AsyncEngine(engine_settings))
    return serve_until_signalled(worker.run, worker.begin_drain)
