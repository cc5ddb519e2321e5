"""What prefill and decode workers share: settings, the control socket, peers, heartbeats.

A worker is one process: an `Engine` stepping on its own thread (`AsyncEngine`), an
asyncio loop on the main thread that owns every socket, and a KV transfer agent over
the engine's pool. The loop never waits on a step, so heartbeats keep flowing while a
long prefill runs.

Control plane: the worker binds one ROUTER socket. Peers (the gateway, decode workers)
connect DEALERs (`services.links`) and open with `Hello`; the worker answers `HelloAck`
(model, context, page size, transfer backend and agent metadata) and from then on
sends each peer a `Heartbeat` with its load every ``heartbeat_interval_s``. A peer
silent for ``peer_timeout_s`` is forgotten and `on_peer_lost` ends its requests.

Each request runs as one asyncio task keyed by its id; an `Abort` cancels that task,
and the task's cleanup returns everything it holds in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import zmq
import zmq.asyncio
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.errors import CapacityError, RequestError
from radixserve.protocol import (
    AsyncChannel,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    ProtocolError,
    RequestFailed,
)
from radixserve.protocol.messages import ErrorType, Role
from radixserve.transfer import KVTransferAgent, PoolCompat, create_agent

logger = logging.getLogger(__name__)


class WorkerSettings(BaseSettings):
    """Settings every worker has; `PrefillSettings` and `DecodeSettings` add their own."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Worker name, unique in the cluster; default '<role>-<port>'.",
    )
    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="Listen address.")
    port: int = Field(0, ge=0, le=65535, description="Control port (ZMQ); 0 = any free port.")
    transfer_backend: Literal["nixl", "zmq"] = Field(
        "nixl", description="How KV pages move between workers: NIXL (UCX) or ZMQ over TCP."
    )
    nixl_progress_thread: bool = Field(
        False,
        description="Give the NIXL agent its own progress thread (it busy-polls a CPU core); "
        "off, the worker drives progress itself while a peer reads its pages.",
    )
    heartbeat_interval_s: float = Field(0.5, gt=0, le=60, description="Heartbeat period.")
    peer_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A peer silent this long is considered dead."
    )
    generation: int | None = Field(
        None, ge=0, description="Incarnation number; default: start time in milliseconds."
    )


@dataclass
class Peer:
    """A process connected to our ROUTER socket."""

    identity: bytes
    name: str
    role: str
    last_seen: float


def error_type(exc: BaseException) -> ErrorType:
    """The wire error type for an exception that ended a request."""
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, RequestError):
        return "invalid_request"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "internal"


class Worker:
    """The shared half of a prefill or decode worker; subclasses handle request messages."""

    role: ClassVar[Role]

    def __init__(self, settings: WorkerSettings, engine: Engine) -> None:
        self.settings = settings
        self.engine = AsyncEngine(engine)
        self.page_size = engine.page_size
        self.generation = (
            settings.generation if settings.generation is not None else time.time_ns() // 10**6
        )
        self.name = settings.name or ""
        self.address = ""
        self.counters: Counter[str] = Counter()
        self.peers: dict[bytes, Peer] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.agent: KVTransferAgent | None = None
        self.context: zmq.asyncio.Context | None = None
        self._router: AsyncChannel | None = None

    # -- lifetime --------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; then end every request and close everything."""
        self.context = zmq.asyncio.Context()
        s = self.settings
        self._router = AsyncChannel.open(
            self.context, zmq.ROUTER, f"tcp://{s.host}:{s.port}", bind=True
        )
        self.address = self._router.endpoint
        self.name = self.name or f"{self.role}-{self.address.rsplit(':', 1)[1]}"
        engine = self.engine.engine
        compat = PoolCompat.from_pool(engine.kv_pool, engine.config.name)
        self.agent = create_agent(
            s.transfer_backend,
            self.name,
            engine.kv_pool,
            compat,
            nixl_progress_thread=s.nixl_progress_thread,
        )
        background = [asyncio.create_task(self._receive()), asyncio.create_task(self._beat())]
        try:
            await self.start()
            print(
                f"radixserve {self.role} worker {self.name} (generation {self.generation}) "
                f"listening on {self.address}, KV transfer over {s.transfer_backend}",
                flush=True,
            )
            await stop.wait()
            logger.info("%s: shutting down", self.name)
        finally:
            for task in [*background, *self.tasks.values()]:
                task.cancel()
            await asyncio.gather(*background, *self.tasks.values(), return_exceptions=True)
            await self.stop()
            self.engine.close()
            self.agent.close()
            self._router.close()
            self.context.term()

    async def start(self) -> None:
        """Role hook: open outgoing links once the control socket is bound."""

    async def stop(self) -> None:
        """Role hook: close outgoing links (requests are already cancelled)."""

    # -- messages --------------------------------------------------------------------

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
            transfer_backend=self.agent.backend_name,
            transfer_metadata=self.agent.metadata() if self.role == "prefill" else b"",
        )

    def handle(self, peer: Peer, msg: Message) -> None:
        """Role hook: a request-level message from ``peer`` (must not block)."""
        logger.warning("%s: unexpected %s from %s", self.name, type(msg).__name__, peer.name)

    def on_peer_lost(self, peer: Peer) -> None:
        """Role hook: ``peer`` went silent; end what it asked for."""

    async def send_to(self, peer: Peer, msg: Message) -> None:
        """Send to a connected peer; a send that fails is logged (the peer may be gone)."""
        assert self._router is not None
        try:
            await self._router.send_to(peer.identity, msg, timeout_ms=1000)
        except (TimeoutError, zmq.ZMQError) as exc:
            logger.warning("%s: cannot send %s to %s: %s", self.name, msg.TYPE_TAG, peer.name, exc)

    async def fail(self, peer: Peer, request_id: str, exc: BaseException) -> None:
        """Tell ``peer`` that ``request_id`` ended with ``exc``."""
        kind = error_type(exc)
        if kind == "internal":
            logger.error("%s: request %s failed: %r", self.name, request_id, exc)
        message = str(exc) or type(exc).__name__
        await self.send_to(peer, RequestFailed(request_id, kind, message[:4096]))

    def spawn(self, request_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as the task of ``request_id`` (cancelled by `cancel`)."""
        if request_id in self.tasks:
            coro.close()
            logger.warning("%s: request %s is already running; ignored", self.name, request_id)
            return
        task = asyncio.create_task(coro)
        self.tasks[request_id] = task
        task.add_done_callback(lambda t: self._done(request_id, t))

    def cancel(self, request_id: str) -> bool:
        task = self.tasks.get(request_id)
        if task is None:
            return False
        task.cancel()
        return True

    def _done(self, request_id: str, task: asyncio.Task) -> None:
        if self.tasks.get(request_id) is task:
            del self.tasks[request_id]
        if not task.cancelled() and task.exception() is not None:
            logger.error("%s: task of %s crashed", self.name, request_id, exc_info=task.exception())

    async def _receive(self) -> None:
        assert self._router is not None
        while True:
            try:
                got = await self._router.recv_from()
            except ProtocolError:
                continue  # logged by the channel; the peer's request times out on its side
            if got is None:
                continue
            identity, msg = got
            now = time.monotonic()
            peer = self.peers.get(identity)
            if isinstance(msg, Hello | Heartbeat):
                name = msg.name if isinstance(msg, Hello) else msg.sender
                role = msg.role if isinstance(msg, Hello) else (peer.role if peer else "")
                if peer is None:
                    peer = self.peers[identity] = Peer(identity, name, role, now)
                    logger.info("%s: peer %s (%s) connected", self.name, name, role or "?")
                peer.last_seen = now
                if isinstance(msg, Hello):
                    peer.role = msg.role
                    await self.send_to(peer, self.hello_ack())
                continue
            if peer is None:  # a request before any hello (e.g. across our restart)
                peer = self.peers[identity] = Peer(identity, "?", "", now)
            peer.last_seen = now
            try:
                self.handle(peer, msg)
            except Exception:
                logger.exception("%s: handling %s failed", self.name, type(msg).__name__)

    async def _beat(self) -> None:
        s = self.settings
        while True:
            now = time.monotonic()
            for identity, peer in list(self.peers.items()):
                if now - peer.last_seen > s.peer_timeout_s:
                    del self.peers[identity]
                    logger.warning(
                        "%s: peer %s went silent; ending its requests", self.name, peer.name
                    )
                    self.on_peer_lost(peer)
                    continue
                beat = Heartbeat(sender=self.name, generation=self.generation, load=self.load())
                await self.send_to(peer, beat)
            await asyncio.sleep(s.heartbeat_interval_s)

    def load(self) -> dict[str, int | float]:
        """Load and counters for heartbeats: pool pages, live requests, role counters."""
        stats: dict[str, int | float] = dict(self.engine.engine.cache_stats())
        stats["tasks"] = len(self.tasks)
        stats.update(self.counters)
        return stats


def run_worker(worker_cls: type[Worker], settings: WorkerSettings) -> int:
    """Build the engine and serve ``worker_cls`` until SIGINT/SIGTERM; the process entry."""
    from radixserve.settings import EngineSettings

    from_env: dict[str, Any] = {}  # every field from RADIXSERVE_* / defaults
    engine = Engine(EngineSettings(**from_env))
    worker = worker_cls(settings, engine)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await worker.run(stop)

    asyncio.run(main())
    sys.stdout.flush()
    return 0
