"""Outgoing control links to workers: connect, hello, heartbeat, notice death and restart.

A `LinkSet` holds one DEALER `AsyncChannel` per worker address. Used by the gateway
(to every decode and prefill worker and the kvstore) and by workers (decode to prefill
workers, each worker to the kvstore). Addresses given at start are *static*; `add` and
`remove` change the set at run time (the membership the kvstore lists,
`radixserve.runtime.membership`).

Contracts:
- A link is *up* from the worker's accepted `HelloAck` until it is silent for
  ``peer_timeout_s``, its TCP connection closes (a process that dies closes its sockets:
  the socket monitor sees it within milliseconds, long before a heartbeat is missed),
  or a heartbeat shows another generation (the worker restarted); then it is *down*,
  ``on_down(link, why)`` runs once, and `Hello` is resent every ``interval_s`` until a
  new `HelloAck` brings it up again (``on_up``). Heartbeats stay for peers that hang
  without closing anything.
- A set given a `PageGeometry` (links to workers whose KV pages this side routes by, or
  reads) refuses a worker whose `HelloAck` names another page size, model identity
  (`ModelIdentity`: weights, quantization, dtype, adapter; the refusal names both) or
  page-hash namespace (identity, cache salt), or, where both sides have a KV pool,
  another pool layout (`PoolCompat`): page hashes would not match, or pages could not
  be copied, so prefix routing and KV transfers would silently go wrong. The link stays
  down; the error is logged once, not at every hello. A side that loads no weights
  (the gateway) gives a `LearnedGeometry` instead: the first decode worker's ack sets
  it (and `recheck` then takes down the links already up that do not match).
- If this process itself did not run for longer than ``peer_timeout_s`` (stopped with
  SIGSTOP, a frozen host), the workers have dropped it as a peer (and the kvstore
  has unlisted it) while the messages they sent before wait in its sockets and look
  fresh: every link goes down and says hello again, so each ``on_up`` rejoins
  (a worker registers with the kvstore again, re-watches, resyncs).
- While up, the set sends every worker a `Heartbeat` each ``interval_s`` (so the
  worker keeps this side as a peer) and records the worker's typed load (``load``,
  `WorkerLoad`) and numbers (``stats``, `ServiceStats`) from its own. A worker whose load says
  ``draining`` is up but not `ready`: nothing new is routed to it.
- Every other message is handed to ``on_message(link, msg)``; a bad frame is logged
  and dropped. Callbacks run on the event loop and must not block.
- ZMQ reconnects by itself; a message sent while a worker is down waits in the socket
  until it is back, so callers only send requests on links that are up.
- A set made with ``tokens`` (the gateway's, to decode workers) also connects, while a
  link is up, a receiving DEALER to the worker's token endpoint when its `HelloAck`
  names one (``token_port``, on the host the link reached; its routing id
  `token_routing_id`, `radixserve.runtime.token_endpoint`): what arrives there goes to
  ``on_message`` as if it came on the link. It closes when the link goes down.
- An address by host name (``tcp://kvstore-a:7000``) is resolved here, off the event loop
  (`_resolve`), and the socket connected to the address it resolves to; while the link is
  down the name is resolved again every ``_RESOLVE_EVERY_S`` and the socket moved if the
  address changed (a restarted pod). ZMQ never sees the name: it resolves names on its
  I/O thread, shared by every socket of the process, so one name that takes seconds to
  fail (a stopped container's, behind a DNS that forwards and times out) would stall
  every link of the process on each reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from radixserve.protocol import (
    AsyncChannel,
    Heartbeat,
    Hello,
    HelloAck,
    Message,
    ProtocolError,
    WorkerLoad,
)
from radixserve.protocol.fields import Role
from radixserve.protocol.security import ClusterKeys
from radixserve.protocol.stats_messages import ServiceStats
from radixserve.runtime.page_geometry import LearnedGeometry, PageGeometry
from radixserve.runtime.token_endpoint import token_routing_id

logger = logging.getLogger(__name__)

_RESOLVE_EVERY_S = 2.0  # how often a down link's host name is resolved again


def _host_name(address: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` address whose host is a name, not an IP
    literal; None for anything else (ZMQ connects those without resolving)."""
    if not address.startswith("tcp://"):
        return None
    host, _, port = address[len("tcp://") :].rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or host == "*":
        return None
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return host, int(port)
    return None


async def monitor_socket(
    socket: zmq.asyncio.Socket, events: int, on_event: Callable[[int], None]
) -> None:
    """Call ``on_event(event)`` for each of ``events`` ZMQ reports on ``socket``, until
    cancelled."""
    monitor = socket.get_monitor_socket(events)
    try:
        while True:
            on_event(parse_monitor_message(await monitor.recv_multipart())["event"])
    finally:
        with contextlib.suppress(zmq.ZMQError):
            socket.disable_monitor()
        monitor.close(linger=0)


@dataclass
class Link:
    """One worker as seen from this side: its socket and what it last told us."""

    address: str
    channel: AsyncChannel
    endpoint: str = ""  # what the socket is connected to ("" for a name not resolved yet)
    name: str = ""
    role: str = ""
    generation: int = -1
    up: bool = False
    last_seen: float = 0.0
    hello_sent: float = -math.inf
    load: WorkerLoad = field(default_factory=WorkerLoad)
    stats: ServiceStats | None = None  # None until its first heartbeat
    ack: HelloAck | None = None
    discovered: bool = False  # added from the membership (not a static address)
    refused: str = ""  # why the last HelloAck was refused (logged once per reason)
    tokens: AsyncChannel | None = None  # to its token endpoint, while up (`LinkSet` tokens)

    @property
    def label(self) -> str:
        return self.name or self.address

    @property
    def ready(self) -> bool:
        """Up and taking new requests (not draining)."""
        return self.up and not self.load.draining

    async def send(self, msg: Message, timeout_ms: int = 2000) -> None:
        """Send ``msg``; `TimeoutError` if the worker is unreachable for ``timeout_ms`` or
        the link was removed meanwhile (its worker left the cluster)."""
        if self.channel.closed:
            raise TimeoutError(f"the link to {self.label} is closed: it left the cluster")
        try:
            await self.channel.send(msg, timeout_ms=timeout_ms)
        except zmq.ZMQError as exc:
            raise TimeoutError(f"cannot send to {self.label}: {exc}") from exc


@dataclass(frozen=True)
class LinkIdentity:
    """Who this process is on every link it opens, and how it watches them."""

    name: str
    role: Role
    generation: int
    interval_s: float
    peer_timeout_s: float
    keys: ClusterKeys | None = None


#: what a link set handles itself (`LinkSet.control`); any other message goes to ``on_message``
LinkControl = HelloAck | Heartbeat


class LinkSet:
    """DEALER links from this process (``me``) to worker addresses: static ones given here,
    more added and removed at run time (`add`, `remove`)."""

    def __init__(
        self,
        context: zmq.asyncio.Context,
        addresses: list[str],
        me: LinkIdentity,
        *,
        on_message: Callable[[Link, Message], None],
        on_up: Callable[[Link], None] | None = None,
        on_down: Callable[[Link, str], None] | None = None,
        pages: PageGeometry | LearnedGeometry | None = None,
        tokens: bool = False,
    ) -> None:
        self._context = context
        self._tokens = tokens  # connect to the workers' token endpoints
        self._keys = me.keys
        self._pages = pages  # None: the peers' pages are not checked
        self.links: list[Link] = []
        self._hello = Hello(name=me.name, role=me.role, generation=me.generation)
        self._name, self._generation = me.name, me.generation
        self._interval, self._timeout = me.interval_s, me.peer_timeout_s
        self._on_message, self._on_up, self._on_down = on_message, on_up, on_down
        self.control: dict[type[Message], Callable[[Link, Any], None]] = {
            HelloAck: self._acked, Heartbeat: self._beat}  # fmt: skip
        # id(link) -> its receive task, its socket monitor task and, by name, its resolver
        self._tasks: dict[int, tuple[asyncio.Task, ...]] = {}
        self._token_tasks: dict[int, asyncio.Task] = {}  # id(link) -> its token receiver
        self._tick_task: asyncio.Task | None = None
        self._started = False
        for address in addresses:
            self.add(address)

    def start(self) -> None:
        """Start receiving and the hello/heartbeat loop (on the running event loop)."""
        self._started = True
        for link in self.links:
            self._watch(link)
        self._tick_task = asyncio.create_task(self._tick())

    async def close(self) -> None:
        tasks = [task for pair in self._tasks.values() for task in pair]
        tasks += [*self._token_tasks.values()]
        tasks += [self._tick_task] if self._tick_task else []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._tasks.clear()
        self._token_tasks.clear()
        for link in self.links:
            link.channel.close()
            self._close_tokens(link)

    def add(self, address: str, discovered: bool = False) -> Link:
        """Link to ``address`` (hello is sent on the next tick); the existing link if any."""
        known = self.by_address(address)
        if known is not None:
            return known
        named = _host_name(address) is not None  # connected once resolved (`_resolve`)
        channel = AsyncChannel.open(self._context, zmq.DEALER, address, bind=False,
                                    keys=self._keys, connect=not named)  # fmt: skip
        link = Link(address, channel, endpoint="" if named else address, discovered=discovered)
        self.links.append(link)
        if self._started:
            self._watch(link)
        return link

    def _watch(self, link: Link) -> None:
        # the link goes down the moment its TCP connection closes
        closed = monitor_socket(link.channel.socket, zmq.EVENT_DISCONNECTED,
                                lambda _: self.mark_down(link, "its connection closed"))  # fmt: skip
        tasks = [asyncio.create_task(self._receive(link)), asyncio.create_task(closed)]
        if (named := _host_name(link.address)) is not None:
            tasks.append(asyncio.create_task(self._resolve(link, *named)))
        self._tasks[id(link)] = tuple(tasks)

    def remove(self, link: Link, why: str) -> None:
        """Drop ``link`` for good (its worker left the cluster): down first if it was up,
        then its socket closes. Safe to call from any callback of this set."""
        if link not in self.links:
            return
        self.mark_down(link, why)
        self.links.remove(link)
        logger.info("forgetting worker %s (%s): %s", link.label, link.address, why)
        for task in self._tasks.pop(id(link), ()):
            if task is not asyncio.current_task():
                task.cancel()
            else:  # called from its own loop: end it after this message
                asyncio.get_running_loop().call_soon(task.cancel)
        link.channel.close()
        self._close_tokens(link)

    def up(self) -> list[Link]:
        return [link for link in self.links if link.up]

    def ready(self) -> list[Link]:
        """Links up and taking new requests."""
        return [link for link in self.links if link.ready]

    def by_address(self, address: str) -> Link | None:
        return next((link for link in self.links if link.address == address), None)

    def mark_down(self, link: Link, why: str) -> None:
        if not link.up:
            return
        link.up = False
        self._close_tokens(link)
        logger.warning("worker %s (%s) is down: %s", link.label, link.address, why)
        if self._on_down is not None:
            self._on_down(link, why)

    async def _resolve(self, link: Link, host: str, port: int) -> None:
        """Keep ``link``'s socket connected to the address its host name resolves to:
        resolved off the event loop now and, while the link is down, every
        ``_RESOLVE_EVERY_S`` (one resolution at a time, however long it takes)."""
        loop = asyncio.get_running_loop()
        while link in self.links:
            if not link.up:
                try:
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
                except OSError as exc:
                    logger.debug("cannot resolve %s for %s: %s", host, link.address, exc)
                    infos = []
                if infos and link in self.links:
                    self._connect(link, str(infos[0][4][0]), port)
            await asyncio.sleep(_RESOLVE_EVERY_S)

    @staticmethod
    def _connect(link: Link, ip: str, port: int) -> None:
        endpoint = f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"
        if endpoint == link.endpoint or link.channel.closed:
            return
        sock = link.channel.socket
        if link.endpoint:
            with contextlib.suppress(zmq.ZMQError):
                sock.disconnect(link.endpoint)
            logger.info("worker %s at %s moved: %s -> %s", link.label, link.address,
                        link.endpoint, endpoint)  # fmt: skip
        sock.connect(endpoint)
        link.endpoint = endpoint

    async def _receive(self, link: Link, tokens: AsyncChannel | None = None) -> None:
        """Hand on what arrives on ``link``'s socket (on its ``tokens`` channel: no link
        control comes there) until the link is removed or the channel closed."""
        channel = tokens or link.channel
        while link in self.links and not channel.closed:
            try:
                msg = await channel.recv()
            except ProtocolError:
                continue  # logged by the channel
            if msg is None:
                continue
            link.last_seen = time.monotonic()
            handler = self._on_message if tokens else self.control.get(type(msg), self._on_message)
            try:
                handler(link, msg)
            except Exception:
                logger.exception("handling %s from %s failed", type(msg).__name__, link.label)

    def _beat(self, link: Link, msg: Heartbeat) -> None:
        if link.up and msg.generation != link.generation:
            self.mark_down(link, f"restarted (generation {msg.generation})")
            link.hello_sent = -math.inf
        elif link.up:
            link.load, link.stats = msg.load, msg.stats

    def _stalled(self, gap_s: float) -> None:
        """This process did not run for ``gap_s``, past the peer timeout: take every link
        down so that it says hello again (see the module doc)."""
        why = f"this process stalled for {gap_s:.1f} s (its peers have dropped it)"
        for link in list(self.links):
            self.mark_down(link, why)
            link.hello_sent = -math.inf

    def recheck(self) -> None:
        """Check every link that is up against the page geometry again (a
        `LearnedGeometry` that has just learned): one that does not match goes down,
        refused as at its hello."""
        for link in self.up():
            ack = link.ack
            mismatch = self._pages.mismatch(ack) if self._pages and ack else ""
            if ack is not None and mismatch:
                self._refuse(link, self._refusal(link, ack, mismatch))
                self.mark_down(link, f"it has other pages ({mismatch})")

    def _refusal(self, link: Link, ack: HelloAck, mismatch: str) -> str:
        return (f"refusing worker {ack.name} ({ack.role}) at {link.address}: {mismatch}, so "
                f"{self._name} cannot share its pages; give every process the same model "
                "and engine settings")  # fmt: skip

    def _acked(self, link: Link, ack: HelloAck) -> None:
        if not ack.accepted:
            self._refuse(link, f"worker at {link.address} refused us: {ack.reason}")
            return
        if link.up and ack.generation == link.generation:
            return  # an answer to a repeated hello
        mismatch = self._pages.mismatch(ack) if self._pages is not None else ""
        if mismatch:
            self._refuse(link, self._refusal(link, ack, mismatch))
            if link.up:  # restarted with other settings
                self.mark_down(link, f"restarted with other pages ({mismatch})")
            return
        link.refused = ""
        if link.up:
            self.mark_down(link, f"restarted (generation {ack.generation})")
        link.name, link.role, link.generation, link.ack = ack.name, ack.role, ack.generation, ack
        link.up = True
        if self._tokens and ack.token_port:
            self._open_tokens(link, ack.token_port)
        logger.info("worker %s (%s) at %s is up", ack.name, ack.role, link.address)
        if self._on_up is not None:
            self._on_up(link)

    def _open_tokens(self, link: Link, port: int) -> None:
        """Connect to ``link``'s token endpoint, on the host its control socket was reached
        at, and hand what arrives to ``on_message``."""
        host = link.endpoint[len("tcp://") :].rpartition(":")[0]
        if not link.endpoint.startswith("tcp://") or not host:
            return  # not over TCP: its tokens come on the link
        identity = token_routing_id(self._name, self._generation)
        link.tokens = AsyncChannel.open(self._context, zmq.DEALER, f"tcp://{host}:{port}",
                                        bind=False, identity=identity, keys=self._keys)  # fmt: skip
        self._token_tasks[id(link)] = asyncio.create_task(self._receive(link, link.tokens))

    def _close_tokens(self, link: Link) -> None:
        task = self._token_tasks.pop(id(link), None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()
        if link.tokens is not None:
            link.tokens.close()
            link.tokens = None

    @staticmethod
    def _refuse(link: Link, why: str) -> None:
        """Leave ``link`` down; log ``why`` unless it is the same as last time (hellos are
        resent every interval, and each gets the same answer)."""
        if why != link.refused:
            logger.error("%s", why)
        link.refused = why

    async def _tick(self) -> None:
        last = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last > self._timeout:
                self._stalled(now - last)
            last = now
            for link in list(self.links):
                if link.up and now - link.last_seen > self._timeout:
                    self.mark_down(link, f"silent for {now - link.last_seen:.1f} s")
                if link not in self.links:
                    continue  # removed by the down callback
                try:
                    if not link.up and now - link.hello_sent >= self._interval:
                        link.hello_sent = now
                        await link.channel.send(self._hello, timeout_ms=0)
                    elif link.up:
                        beat = Heartbeat(sender=self._name, generation=self._generation)
                        await link.channel.send(beat, timeout_ms=0)
                except (TimeoutError, zmq.ZMQError):
                    pass  # not connected yet: the next tick tries again
            await asyncio.sleep(self._interval)
