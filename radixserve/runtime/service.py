"""A service process's control plane: one ROUTER socket, peers, heartbeats, request tasks,
and the drain that ends it.

Every service (prefill and decode workers, the kvstore) binds one ROUTER socket. Peers
connect DEALERs (`radixserve.runtime.links`) and open with `Hello`; the service answers
`hello_ack()` and from then on sends each peer a `Heartbeat` with `load()` (typed, for
routers) and `stats()` (counters, for metrics) every ``heartbeat_interval_s``. A peer
silent for ``peer_timeout_s`` is forgotten and `on_peer_lost` ends what it asked for.
Each request runs as one asyncio task keyed by its id (`spawn`); `cancel` ends it, and
the task's own cleanup returns what it holds. Everything runs on one asyncio loop;
nothing here blocks it.

**Drain** (SIGTERM, `drain`): the service reports ``draining`` in its next heartbeat (at
once) and through `on_drain`, refuses new requests (`refused_while_draining` message
types get `RequestFailed` "draining", which senders retry elsewhere), waits until
`busy()` is false or ``drain_grace_s`` has passed, cancels whatever is left (each task's
cleanup still returns what it holds), calls `on_drained` (leave the membership) and
stops; the process exits 0. SIGINT, or a second SIGTERM, stops at once.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar

import zmq
import zmq.asyncio

from radixserve.errors import CapacityError, ConfigurationError, RequestError
from radixserve.launch.listeners import adopt_fd
from radixserve.protocol import (
    AsyncChannel,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    ProtocolError,
    RequestFailed,
    WorkerLoad,
)
from radixserve.protocol.fields import ErrorType, Role
from radixserve.protocol.security import HANDSHAKE_FAILURES, keys_from
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.runtime.calls import Tasks
from radixserve.runtime.links import LinkIdentity, monitor_socket
from radixserve.runtime.network import default_name
from radixserve.runtime.probe import ProbeServer
from radixserve.runtime.settings import ServiceSettings
from radixserve.transfer.network import advertise_host, url_host
from radixserve.worker_metrics import service_metrics

logger = logging.getLogger(__name__)


@dataclass
class Peer:
    """A process connected to our ROUTER socket."""

    identity: bytes
    name: str
    role: str
    last_seen: float
    generation: int = -1  # its `Hello`'s (-1: none heard)


#: a channel's handler table: message type -> its handler (sender: a `Peer` or a `Link`;
#: message), run on the event loop; an async one on a `Service`'s socket runs as a task
Handlers = dict[type[Message], Callable[[Any, Any], Coroutine[Any, Any, None] | None]]


def dispatch(table: Handlers, sender: Any, msg: Message) -> bool:
    """Run ``msg``'s handler in ``table``; False if it has none (an unexpected message)."""
    handler = table.get(type(msg))
    if handler is not None:
        handler(sender, msg)
    return handler is not None


def error_type(exc: BaseException) -> ErrorType:
    """The wire error type for an exception that ended a request."""
    if isinstance(exc, CapacityError):
        return "capacity"
    if isinstance(exc, RequestError):
        return "invalid_request"
    if isinstance(exc, TimeoutError):
        return "timeout"
    return "internal"


class Service:
    """The control plane of one service process; subclasses handle request messages."""

    role: ClassVar[Role]
    #: request messages answered `RequestFailed` ("draining") once the drain has begun
    refused_while_draining: ClassVar[tuple[type[Message], ...]] = ()

    def __init__(self, settings: ServiceSettings) -> None:
        settings.require_secure(self.role)  # off loopback only with the cluster secret
        self.settings = settings
        self.generation = (
            settings.generation if settings.generation is not None else time.time_ns() // 10**6
        )
        self.name = settings.name or ""
        self.keys = keys_from(settings.cluster_secret)  # None: no authentication
        self.address = ""  # as bound (tcp://host:port)
        self.advertised_address = ""  # as others dial it
        self.started_at = time.monotonic()
        self.draining = False
        # events counted, by the name of their `ServiceStats` field (each exported at 0
        # from the first heartbeat: a dashboard's rate() over a series that appears only
        # with its first event misses it)
        self.counters: Counter[str] = Counter()
        self.peers: dict[bytes, Peer] = {}
        self.tasks: dict[str, asyncio.Task] = {}
        self.notices = Tasks(self.role)  # fire-and-forget sends in flight
        self._beat_now = asyncio.Event()
        self._stop: asyncio.Event | None = None
        self._drain: asyncio.Task | None = None
        self._background: list[asyncio.Task] = []  # loops that run until the service stops
        self.context: zmq.asyncio.Context | None = None
        self._router: AsyncChannel | None = None
        self.probe: ProbeServer | None = None  # the HTTP side, with settings.http_port
        self.serving = False  # started and not yet stopping

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; then end every request and close everything."""
        self.context = zmq.asyncio.Context()
        self._stop = stop
        s = self.settings
        address = f"tcp://{url_host(s.host)}:{s.port}"
        try:
            self._router = AsyncChannel.open(
                self.context,
                zmq.ROUTER,
                address,
                bind=True,
                keys=self.keys,
                # the socket radixserve up's supervisor bound for this service, if any
                use_fd=None if s.listen_fd is None else adopt_fd(s.listen_fd),
            )
        except zmq.ZMQError as exc:
            self.context.term()
            raise cannot_listen(self.role, "control socket", address, exc, "PORT") from exc
        self.address = self._router.endpoint
        port = int(self.address.rsplit(":", 1)[1])
        host = advertise_host(s.host, s.advertise_host)
        self.advertised_address = f"tcp://{url_host(host)}:{port}"
        self.name = self.name or default_name(self.role, host, port)
        try:
            await self.start()
            if s.http_port is not None:
                self.probe = ProbeServer(s.http_host or s.host, s.http_port, self.health,
                                         self.metrics_text)  # fmt: skip
                await self.probe.start()
            self.run_in_background(self._receive())
            self.run_in_background(self._beat())
            if self.keys is not None:  # count the peers that lack the cluster secret
                self.run_in_background(monitor_socket(self._router.socket, HANDSHAKE_FAILURES,
                                                      self._refused))  # fmt: skip
            self.serving = True
            http = f", HTTP on {self.probe.url}" if self.probe else ""
            print(f"radixserve {self.role} {self.name} (generation {self.generation}) "
                  f"listening on {self.address}{http}{self.describe()}", flush=True)  # fmt: skip
            await stop.wait()
            logger.info("%s: shutting down", self.name)
        finally:
            self.serving = False
            if self.probe is not None:
                await self.probe.close()
            if self._drain is not None:
                self._drain.cancel()
                self._background.append(self._drain)
            for task in [*self._background, *self.tasks.values()]:
                task.cancel()
            await asyncio.gather(*self._background, *self.tasks.values(), return_exceptions=True)
            await self.stop()
            self._router.close()
            self.context.term()

    async def start(self) -> None:
        """Hook: set up what the service needs once its control socket is bound."""

    async def stop(self) -> None:
        """Hook: release what `start` set up (request tasks and the loops run in the
        background are already cancelled)."""

    def run_in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` (a loop) until the service stops; it is cancelled before `stop`."""
        self._background.append(asyncio.create_task(coro))

    def describe(self) -> str:
        """Hook: a suffix for the start-up line."""
        return ""

    def hello_ack(self) -> HelloAck:
        """Hook: the answer to a peer's `Hello`."""
        return HelloAck(name=self.name, role=self.role, generation=self.generation)

    def handlers(self) -> Handlers:
        """Hook: the handler of each type of the role's request union (`DecodeInbound`…):
        a bound method (peer, message); a subclass adds its own to its base's table."""
        return {}

    @functools.cached_property
    def _inbound_handlers(self) -> Handlers:
        return self.handlers()

    def handle(self, peer: Peer, msg: Message) -> None:
        """A request-level message from ``peer``: its handler runs (an async one as a task
        of its own, `spawn_notice`); any other is logged."""
        handler = self._inbound_handlers.get(type(msg))
        if handler is None:
            logger.warning("%s: unexpected %s from %s", self.name, type(msg).__name__, peer.name)
        elif (notice := handler(peer, msg)) is not None:
            self.spawn_notice(notice)

    def on_peer_lost(self, peer: Peer) -> None:
        """Hook: ``peer`` went silent; end what it asked for."""

    def load(self) -> WorkerLoad:
        """Hook: the typed load sent in heartbeats (routers and the autoscaler read it)."""
        return WorkerLoad(draining=self.draining)

    def stats(self) -> ServiceStats:
        """The numbers sent in heartbeats, for metrics, /debug/cache and the explorer;
        subclasses add their sections (`dataclasses.replace`)."""
        c = self.counters
        return ServiceStats(
            tasks=len(self.tasks),
            uptime_s=round(time.monotonic() - self.started_at, 3),
            heartbeats_total=c["heartbeats_total"],
            refused_draining_total=c["refused_draining_total"],
            auth_refused_total=c["auth_refused_total"],
        )

    # -- HTTP side ----------------------------------------------------------------------

    def health(self) -> tuple[bool, dict[str, Any]]:
        """Hook: whether this service can serve now (readiness), and why. Not while
        starting, stopping or draining; subclasses add their own conditions."""
        detail: dict[str, Any] = {"name": self.name, "role": self.role,
                                  "generation": self.generation, "draining": self.draining}  # fmt: skip
        return self.serving and not self.draining, detail

    def metrics_text(self) -> bytes:
        """This process's own numbers — its heartbeat's `stats()` and typed `load()` — as
        the gateway exports them per worker (`radixserve.worker_metrics.service_metrics`)."""
        return service_metrics(self.name, self.role, self.load(), self.stats())

    # -- drain ------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """Start draining (SIGTERM); a second call stops at once."""
        if self._drain is not None:
            logger.warning("%s: asked again to stop while draining; stopping now", self.name)
            if self._stop is not None:
                self._stop.set()
            return
        self._drain = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        await self.drain()
        if self._stop is not None:
            self._stop.set()

    async def drain(self) -> None:
        """Take no new requests; let the running ones finish within ``drain_grace_s``,
        then abort what is left and leave (`on_drained`)."""
        self.draining = True
        grace = self.settings.drain_grace_s
        logger.warning("%s: draining (up to %g s for %d running requests)", self.name, grace,
                       len(self.tasks))  # fmt: skip
        self.beat_now()
        self.on_drain()
        deadline = time.monotonic() + grace
        while self.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.tasks:
            logger.warning("%s: drain grace of %g s is over; aborting %d requests", self.name,
                           grace, len(self.tasks))  # fmt: skip
            for task in list(self.tasks.values()):
                task.cancel()
            await asyncio.gather(*self.tasks.values(), return_exceptions=True)
        await self.on_drained()
        logger.warning("%s: drained; leaving", self.name)

    def busy(self) -> bool:
        """Hook: whether anything still needs this process (the drain waits for it)."""
        return bool(self.tasks)

    def on_drain(self) -> None:
        """Hook: the drain began (say so to the membership)."""

    async def on_drained(self) -> None:
        """Hook: the drain is done; leave the membership."""

    # -- sending ----------------------------------------------------------------------

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
        await self.reply(peer, request_id, RequestFailed(request_id, kind, message[:4096]))

    async def reply(self, peer: Peer, request_id: str, msg: Message) -> None:
        """Hook: send ``peer`` a message about its request ``request_id`` (`send_to`; a
        decode worker's may go on its token endpoint, in order with the request's tokens)."""
        await self.send_to(peer, msg)

    def spawn(self, request_id: str, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` as the task of ``request_id`` (cancelled by `cancel`)."""
        if request_id in self.tasks:
            coro.close()
            logger.warning("%s: request %s is already running; ignored", self.name, request_id)
            return
        task = asyncio.create_task(coro)
        self.tasks[request_id] = task
        task.add_done_callback(lambda t: self._done(request_id, t))

    def spawn_notice(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run a short fire-and-forget coroutine (a send) without blocking the caller."""
        self.notices.spawn(coro)

    def identity(self) -> LinkIdentity:
        """This service on the links it opens (every `LinkSet` it makes gets this)."""
        s = self.settings
        return LinkIdentity(self.name, self.role, self.generation, s.heartbeat_interval_s,
                            s.peer_timeout_s, self.keys)  # fmt: skip

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

    # -- receiving --------------------------------------------------------------------

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
                elif peer.name == "?":  # it spoke before its hello (e.g. across our restart)
                    peer.name, peer.role = name, role
                    logger.info("%s: peer %s (%s) named", self.name, name, role or "?")
                peer.last_seen = now
                if isinstance(msg, Hello):
                    peer.role, peer.generation = msg.role, msg.generation
                    await self.send_to(peer, self.hello_ack())
                continue
            if peer is None:  # a request before any hello (e.g. across our restart)
                peer = self.peers[identity] = Peer(identity, "?", "", now)
            peer.last_seen = now
            if self.draining and isinstance(msg, self.refused_while_draining):
                self.counters["refused_draining_total"] += 1
                rid = getattr(msg, "request_id", "")
                refusal = RequestFailed(rid, "draining", f"{self.name} is draining")
                self.spawn_notice(self.send_to(peer, refusal))
                continue
            try:
                self.handle(peer, msg)
            except Exception:
                logger.exception("%s: handling %s failed", self.name, type(msg).__name__)

    async def _beat(self) -> None:
        s = self.settings
        while True:
            now = time.monotonic()
            # numbers the beats: a reader waiting for one sent after an event waits for a
            # higher number, not for a guessed interval
            self.counters["heartbeats_total"] += 1
            for identity, peer in list(self.peers.items()):
                if now - peer.last_seen > s.peer_timeout_s:
                    del self.peers[identity]
                    logger.warning(
                        "%s: peer %s went silent; ending its requests", self.name, peer.name
                    )
                    self.on_peer_lost(peer)
                    continue
                beat = Heartbeat(self.name, self.generation, self.load(), self.stats())
                await self.send_to(peer, beat)
            self._beat_now.clear()
            await wait_event(self._beat_now, s.heartbeat_interval_s)

    def _refused(self, _event: int) -> None:
        """A peer's handshake failed: none of its frames reached us."""
        self.counters["auth_refused_total"] += 1

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the load changed in a way routers should see)."""
        self._beat_now.set()


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Wait until ``event`` is set or ``timeout_s`` passes; whether it is set. (Not
    `asyncio.wait_for`: before Python 3.12 it can swallow a cancel that arrives just as
    the event is set, and a task that ignores its cancel never ends.)"""
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout_s)
    finally:
        waiter.cancel()
    return event.is_set()


def cannot_listen(
    role: str, what: str, address: str, exc: zmq.ZMQError, setting: str
) -> ConfigurationError:
    """The error of a socket that cannot bind: what, where, why and which setting moves it."""
    who = role if role == "kvstore" else f"{role} worker"
    flag = " or --port" if setting == "PORT" else ""
    return ConfigurationError(
        f"the {who}'s {what} cannot listen on {address}: {zmq.strerror(exc.errno or 0)} "
        f"(RADIXSERVE_{role.upper()}_{setting}{flag} sets its port; 0 takes any free one)"
    )


def serve_until_signalled(
    run: Callable[[asyncio.Event], Awaitable[None]], on_sigterm: Callable[[], None] | None = None
) -> int:
    """Run ``run(stop)`` until SIGINT sets ``stop`` or SIGTERM calls ``on_sigterm`` (a
    service's `begin_drain`: drain, then stop; default: stop now); the body of a service's
    process entry. Exits 0 either way."""

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, on_sigterm or stop.set)
        await run(stop)

    try:
        asyncio.run(main())
    except ConfigurationError as exc:  # e.g. a port taken: said, not a traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sys.stdout.flush()
    return 0
