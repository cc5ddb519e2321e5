"""What prefill and decode workers share: an engine and a KV transfer agent behind a service.

A worker is one process: an `Engine` stepping on its own thread (`AsyncEngine`), the
service control plane (`services.runtime.service`) on an asyncio loop on the main thread that
owns every socket, and a KV transfer agent over the engine's pool. The loop never
waits on a step, so heartbeats and aborts flow while a long prefill runs. A worker's
`HelloAck` says what it serves (model, context, page size) and, for a prefill worker,
carries its transfer agent's metadata.

With a kvstore configured (``kvstore``, or ``radixserve prefill|decode --join``), the
worker is a member of that cluster: it registers there when the link comes up
(`Register`: name, role, the address to dial, draining or not), says so again when it
starts draining, and deregisters when the drain is done; routers learn of it from the
kvstore (`services.runtime.membership`). A worker that routes to others (decode, to
prefill workers) also watches the membership through the same link.

With a kvstore and a prefix cache, the worker publishes its radix cache's events (`KVEvent`:
pages stored and removed, by chained hash, numbered per generation) over a link to it;
when the link comes up or the kvstore asks (`KVResync`), it sends ``cleared`` and a
snapshot of every cached page. Events go through one queue in the order the engine
thread made them, so a snapshot never overtakes an earlier event. If the kvstore has a
host tier, the worker also spills evicted pages into it and loads prefixes it misses on
device from it (`services.runtime.host_tier`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Literal

from pydantic import Field

from radixserve.engine.admission import Admission
from radixserve.engine.async_engine import AsyncEngine, OutputQueue
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.protocol import (
    Deregister,
    HelloAck,
    KVEvent,
    KVResync,
    MemberInfo,
    MemberList,
    Message,
    Register,
    WorkerLoad,
)
from radixserve.services.runtime.host_tier import HostTierClient
from radixserve.services.runtime.links import Link, LinkSet
from radixserve.services.runtime.membership import MemberView
from radixserve.services.runtime.service import (
    Service,
    ServiceSettings,
    serve_until_signalled,
    transfer_network,
)
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent

logger = logging.getLogger(__name__)


class WorkerSettings(ServiceSettings):
    """Settings every worker has; `PrefillSettings` and `DecodeSettings` add their own."""

    transfer_backend: Literal["nixl", "zmq"] = Field(
        "nixl", description="How KV pages move between workers: NIXL (UCX) or ZMQ over TCP."
    )
    nixl_progress_thread: bool = Field(
        False,
        description="Give the NIXL agent its own progress thread (it busy-polls a CPU core); "
        "off, the worker drives progress itself while a peer reads its pages.",
    )
    kvstore: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Control address of the cluster's kvstore (tcp://host:port): the worker "
        "registers there (so routers find it) and publishes its cache events; none = a "
        "worker known only by static addresses.",
    )
    host_tier: bool = Field(
        True,
        description="Spill evicted pages into the kvstore's host tier and load prefixes "
        "missing on device from it (when the kvstore has one).",
    )
    host_spill_buffer_mib: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Host buffer that evicted pages are copied into until the kvstore has "
        "read them; when full, further evicted pages are dropped.",
    )
    host_write_through_uses: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="Also write a cached prefix to the host tier once this many requests "
        "used it (1 = as soon as it is computed); 0 = only on eviction (write-back).",
    )
    host_lookup_timeout_s: float = Field(
        0.2, gt=0, le=60, description="Longest wait for the kvstore's host-tier lookup."
    )
    host_load_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest read of host-tier pages."
    )


class Worker(Service):
    """A service with an engine and a transfer agent; subclasses handle request messages."""

    settings: WorkerSettings

    def __init__(self, settings: WorkerSettings, engine: Engine | Callable[[], Engine]) -> None:
        """``engine``, or what builds it on the engine thread (`AsyncEngine`)."""
        super().__init__(settings)
        self.engine = AsyncEngine(engine)
        self.page_size = self.engine.engine.page_size
        self.agent: KVTransferAgent | None = None
        self.kvstore: LinkSet | None = None
        self.host: HostTierClient | None = None
        self._events: asyncio.Queue[tuple[str, list[int]]] = asyncio.Queue()
        self._seq = 0
        self._publisher: asyncio.Task | None = None
        self._emit: Callable[[str, list[int]], None] | None = None  # engine thread -> queue
        # hashes of the pages in the engine's radix cache, as of the last event published
        self.cached_hashes: set[int] = set()

    async def start(self) -> None:
        s = self.settings
        engine = self.engine.engine
        compat = PoolCompat.from_pool(engine.kv_pool, engine.config.name)
        self.agent = create_agent(
            s.transfer_backend,
            self.name,
            engine.kv_pool,
            compat,
            nixl_progress_thread=s.nixl_progress_thread,
            network=transfer_network(s),
        )
        if not s.kvstore:
            return
        assert self.context is not None
        self.kvstore = LinkSet(
            self.context,
            [s.kvstore],
            name=self.name,
            role=self.role,
            generation=self.generation,
            interval_s=s.heartbeat_interval_s,
            peer_timeout_s=s.peer_timeout_s,
            on_message=self._from_kvstore,
            on_up=self._kvstore_up,
            on_down=self._kvstore_down,
            keys=self.keys,
        )
        if engine.cache is not None:
            loop = asyncio.get_running_loop()
            if s.host_tier:
                self.host = HostTierClient(self)
            self._publisher = asyncio.create_task(self._publish())

            def emit(kind: str, hashes: list[int]) -> None:  # on the engine thread
                loop.call_soon_threadsafe(self._events.put_nowait, (kind, hashes))

            self._emit = emit
            engine.cache.set_event_listener(emit)
        self.kvstore.start()

    async def stop(self) -> None:
        if self.kvstore is not None:
            await self.kvstore.close()
        if self._publisher is not None:
            self._publisher.cancel()
            await asyncio.gather(self._publisher, return_exceptions=True)
        if self.host is not None:
            await self.host.close()
        self.engine.close()
        if self.agent is not None:
            self.agent.close()

    # -- membership -------------------------------------------------------------------

    def member(self) -> MemberInfo:
        return MemberInfo(
            self.name, self.role, self.advertised_address, self.generation, self.draining
        )

    def member_view(self) -> MemberView | None:
        """Hook: the view of the roles this worker routes to (watched through the kvstore)."""
        return None

    async def _to_kvstore(self, msg: Message, timeout_ms: int = 0) -> None:
        link = self.kvstore.links[0] if self.kvstore else None
        if link is None or not link.up:
            return
        try:
            await link.send(msg, timeout_ms=timeout_ms)
        except TimeoutError:
            logger.warning("%s: cannot reach the kvstore with %s", self.name, msg.TYPE_TAG)

    def on_drain(self) -> None:
        self.spawn_notice(self._to_kvstore(Register(self.member())))

    async def on_drained(self) -> None:
        await self._to_kvstore(Deregister(self.name, self.generation), timeout_ms=1000)
        # sockets close with linger 0: give the message a moment on the wire (if it is
        # lost anyway, the kvstore drops us when our heartbeats stop)
        await asyncio.sleep(0.1)

    def describe(self) -> str:
        return f", KV transfer over {self.settings.transfer_backend}"

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Ready once the engine is loaded and the transfer agent made (the service
        started), with the kvstore link up when there is a kvstore, and not draining."""
        ok, detail = super().health()
        ok = ok and self.agent is not None
        if self.settings.kvstore:
            link = self.kvstore.links[0] if self.kvstore else None
            detail["kvstore"] = "up" if link is not None and link.up else "down"
            ok = ok and detail["kvstore"] == "up"
        return ok, detail

    def hello_ack(self) -> HelloAck:
        engine = self.engine.engine
        assert self.agent is not None
        return HelloAck(
            name=self.name,
            role=self.role,
            generation=self.generation,
            model_name=engine.config.name,
            max_model_len=engine.max_model_len,
            page_size=engine.page_size,
            transfer_metadata=self.agent.metadata() if self.role == "prefill" else b"",
        )

    def _snapshot(self, engine: Engine) -> None:
        """On the engine thread: queue "cleared", then every cached page as "stored"."""
        assert engine.cache is not None and self._emit is not None
        self._emit("cleared", [])
        self._emit("stored", engine.cache.all_page_hashes())

    async def _publish(self) -> None:
        """Send queued cache events to the kvstore, numbered; a lost one shows as a gap.
        They also keep `cached_hashes`, this loop's view of the device cache."""
        while True:
            kind, hashes = await self._events.get()
            if kind == "stored":
                self.cached_hashes.update(hashes)
            elif kind == "removed":
                self.cached_hashes.difference_update(hashes)
            else:
                self.cached_hashes.clear()
            self._seq += 1
            link = self.kvstore.links[0] if self.kvstore else None
            if link is None or not link.up:
                continue  # the kvstore resyncs us when the link comes up
            event = KVEvent(self.name, self.generation, self._seq, kind, tuple(hashes))
            try:
                await link.send(event, timeout_ms=0)
            except TimeoutError:
                self.counters["kv_events_dropped_total"] += 1

    def _kvstore_up(self, link: Link) -> None:
        self.spawn_notice(self._to_kvstore(Register(self.member())))
        view = self.member_view()
        if view is not None:
            self.spawn_notice(self._to_kvstore(view.watch()))
        if self._emit is not None:
            self.engine.submit(self._snapshot)
        if self.host is not None:
            self.host.on_up(link)

    def _kvstore_down(self, link: Link, why: str) -> None:
        if self.host is not None:
            self.host.on_down(link, why)

    def _from_kvstore(self, link: Link, msg: Message) -> None:
        view = self.member_view()
        if isinstance(msg, MemberList) and view is not None:
            view.apply(msg)
        elif isinstance(msg, KVResync):
            if self._emit is not None:
                self.engine.submit(self._snapshot)
        elif self.host is None or not self.host.on_message(link, msg):
            logger.warning("%s: unexpected %s from the kvstore", self.name, msg.TYPE_TAG)

    async def admit(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        remote_over: int | None = None,
        lease_s: float | None = None,
        resume: list[int] | None = None,
    ) -> tuple[Admission, OutputQueue]:
        """A request's one admission: the host-tier lease past the device hit (a kvstore
        round trip, skipped when the device covers the prompt), then one engine operation
        (`Engine.admit`); on the host route the read and `finish_host_admission` follow
        without waiting for a step. The admission and the queue of the request's
        outputs (its first one comes at the end of the next step on the local route).
        ``resume``: a migrated stream's tokens so far (`Engine.admit`)."""
        resume = resume or []
        known = prompt_ids + resume
        planned = await self.host.plan(request_id, known) if self.host else None
        plan, lease = planned if planned is not None else (None, None)
        try:
            admission, out = await self.engine.call(
                lambda e: e.admit(prompt_ids, params, request_id, remote_over=remote_over,
                                  host=plan, lease_s=lease_s, resume=resume),
                watch=request_id,
            )  # fmt: skip
            assert out is not None
            if admission.route == "host":
                assert self.host is not None and lease is not None
                try:
                    ok = await self.host.read(lease, admission.page_ids)
                except BaseException:  # cancelled mid-read: the read cannot land any more
                    self.engine.abort(request_id)
                    raise
                self.engine.submit(lambda e: e.finish_host_admission(request_id, ok))
        finally:
            if lease is not None and self.host is not None:
                self.host.release(lease)
        return admission, out

    def load(self) -> WorkerLoad:
        engine = self.engine.engine
        return WorkerLoad(
            queued_tokens=self.queued_tokens(),
            running=len(engine.scheduler.running),
            waiting=len(engine.scheduler.waiting),
            draining=self.draining,
        )

    def queued_tokens(self) -> int:
        """Hook: prompt tokens accepted and not computed yet (see `WorkerLoad`)."""
        return 0

    def stats(self) -> dict[str, int | float]:
        """Pool pages, live requests and the engine's step counters, then the service's
        tasks and counters, then the host tier's."""
        engine = self.engine.engine
        stats: dict[str, int | float] = dict(engine.cache_stats())
        stats.update(engine.step_counters())
        stats.update(super().stats())
        if self.host is not None:
            stats.update(self.host.stats())
        return stats


def run_worker(worker_cls: type[Worker], settings: WorkerSettings) -> int:
    """Build the engine and serve ``worker_cls`` until SIGINT/SIGTERM; the process entry."""
    from radixserve.settings import EngineSettings

    from_env: dict[str, Any] = {}  # every field from RADIXSERVE_* / defaults
    # built on the engine thread, where it steps (`AsyncEngine`)
    return serve_until_signalled(worker_cls(settings, lambda: Engine(EngineSettings(**from_env))))
