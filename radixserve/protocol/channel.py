"""Typed ZMQ channels: sockets that send and receive protocol messages.

A channel wraps one DEALER, ROUTER, PUSH or PULL socket (sync `Channel` over a
`zmq.Context`, `AsyncChannel` over a `zmq.asyncio.Context`). Framing:

    DEALER / PUSH send   [frame]              DEALER / PULL receive [frame]
    ROUTER send_to       [identity, frame]    ROUTER recv_from      [identity, frame]

Contracts:
- ``send`` / ``send_to`` encode with the codec (a bad message raises `ProtocolError`
  before anything is sent). With ``timeout_ms`` they raise `TimeoutError` when the
  socket cannot take the message in time (e.g. a PUSH with no connected peer).
- ``recv`` / ``recv_from`` return None when nothing arrives within ``timeout_ms``
  (None = wait forever, 0 = poll). A bad frame is logged as a warning and raised as
  `ProtocolError` (with the sender's ``identity`` on a ROUTER); the channel stays usable,
  the caller decides whether to drop the frame or the peer.
- ROUTER sockets use ``recv_from`` / ``send_to``; the others ``recv`` / ``send``.
- Sockets are created with linger 0, ``MAXMSGSIZE`` = ``max_frame_bytes`` (zmq
  disconnects a peer that sends a larger frame) and, on ROUTER, ``ROUTER_HANDOVER`` (a
  restarted peer reusing its identity takes the route over). With ``keys``
  (`radixserve.protocol.security`), a socket that binds is a CURVE server and one that
  connects a CURVE client: only peers that know the cluster secret get through. ``close`` never blocks
  and drops messages still queued: close only once the peer has confirmed delivery
  (a reply) when it matters.
- One thread (or one task) uses a channel at a time; zmq sockets are not thread-safe.
"""

from __future__ import annotations

import logging
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from radixserve.protocol.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode, encode
from radixserve.protocol.security import ClusterKeys
from radixserve.protocol.wire import Message

logger = logging.getLogger(__name__)

_SOCKET_NAMES: dict[int, str] = {
    zmq.DEALER: "DEALER", zmq.ROUTER: "ROUTER", zmq.PUSH: "PUSH", zmq.PULL: "PULL"
}  # fmt: skip
SUPPORTED_SOCKET_TYPES: frozenset[int] = frozenset(_SOCKET_NAMES)


_C = TypeVar("_C", bound="_ChannelBase")


class _ChannelBase:
    """Framing, validation and lifetime shared by the sync and asyncio channels."""

    @classmethod
    def open(
        cls: type[_C],
        context: zmq.Context[Any],
        socket_type: int,
        address: str,
        *,
        bind: bool,
        identity: bytes | None = None,
        max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
        keys: ClusterKeys | None = None,
        use_fd: int | None = None,
        connect: bool = True,
    ) -> _C:
        """A channel on a new socket bound (``bind``) or connected to ``address``; pass a
        `zmq.asyncio.Context` for an `AsyncChannel`. ``use_fd``: bind by serving on this
        listening TCP socket's descriptor (ZMQ's ``USE_FD``; the socket closes it) rather
        than binding ``address``'s port (`radixserve.launch.listeners`). ``connect``
        False: not connected yet (the caller connects the socket to an endpoint it
        resolved itself)."""
        socket = context.socket(socket_type)
        try:
            if keys is not None:
                keys.secure(socket, bind)
            if use_fd is not None:
                socket.setsockopt(zmq.USE_FD, use_fd)
            kind = int(socket.type)
            if kind not in SUPPORTED_SOCKET_TYPES:
                raise ValueError(f"unsupported socket type {kind}")
            if not address.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"address must be tcp://, ipc:// or inproc://, got {address!r}")
            socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)  # (linger 0: set by `__init__`)
            if identity is not None:
                socket.setsockopt(zmq.IDENTITY, identity)
            if kind == zmq.ROUTER:
                socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
            if bind:
                socket.bind(address)
            elif connect:
                socket.connect(address)
            return cls(socket, max_frame_bytes=max_frame_bytes)
        except BaseException:
            socket.close(linger=0)
            raise

    def __init__(
        self, socket: zmq.Socket[Any], *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        self._socket = socket
        self._type = int(socket.type)
        if self._type not in SUPPORTED_SOCKET_TYPES:
            raise ValueError(f"unsupported socket type {self._type}; use DEALER/ROUTER/PUSH/PULL")
        self._max_frame_bytes = max_frame_bytes
        socket.setsockopt(zmq.LINGER, 0)

    @property
    def socket(self) -> zmq.Socket[Any]:
        """The wrapped socket (for polling together with other sockets)."""
        return self._socket

    @property
    def endpoint(self) -> str:
        """The last bound or connected address, with the real port for ``tcp://...:*``."""
        return str(self._socket.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def closed(self) -> bool:
        return bool(self._socket.closed)

    def close(self) -> None:
        """Close the socket at once, dropping unsent messages (linger 0). Idempotent."""
        if not self._socket.closed:
            self._socket.close(linger=0)

    def _frames(self, msg: Message, identity: bytes | None) -> list[bytes]:
        """The multipart frames carrying ``msg`` (to ``identity`` on a ROUTER)."""
        if self._type == zmq.PULL:
            raise ValueError("a PULL socket cannot send")
        if (identity is None) == (self._type == zmq.ROUTER):
            wanted = "send_to(identity, msg)" if identity is None else "send(msg)"
            raise ValueError(f"a {self._name} socket sends with {wanted}")
        frame = encode(msg, max_frame_bytes=self._max_frame_bytes)
        return [frame] if identity is None else [identity, frame]

    def _check_recv(self, routed: bool) -> None:
        if self._type == zmq.PUSH:
            raise ValueError("a PUSH socket cannot receive")
        if routed != (self._type == zmq.ROUTER):
            wanted = "recv_from" if self._type == zmq.ROUTER else "recv"
            raise ValueError(f"a {self._name} socket receives with {wanted}()")

    def _message(self, frames: list[bytes] | None) -> Message | None:
        return None if frames is None else self._parse(frames)[1]

    def _routed(self, frames: list[bytes] | None) -> tuple[bytes, Message] | None:
        if frames is None:
            return None
        identity, msg = self._parse(frames)
        assert identity is not None
        return identity, msg

    def _parse(self, frames: list[bytes]) -> tuple[bytes | None, Message]:
        """The sender's identity (ROUTER only) and the decoded message of ``frames``."""
        identity: bytes | None = None
        try:
            if self._type == zmq.ROUTER:
                identity = frames[0]
                frames = frames[1:]
            if len(frames) != 1:
                raise ProtocolError(f"expected 1 message frame, got {len(frames)}")
            return identity, decode(frames[0], max_frame_bytes=self._max_frame_bytes)
        except ProtocolError as exc:
            where = self._endpoint_or_none()
            logger.warning("bad frame on %s %s from %r: %s", self._name, where, identity, exc)
            raise ProtocolError(str(exc), identity=identity) from exc

    @property
    def _name(self) -> str:
        return _SOCKET_NAMES[self._type]

    def _endpoint_or_none(self) -> str | None:
        try:
            return self.endpoint
        except zmq.ZMQError:
            return None


class Channel(_ChannelBase):
    """A blocking channel over a `zmq.Context` socket."""

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def send(self, msg: Message, *, timeout_ms: int | None = None) -> None:
        """Send ``msg`` (DEALER, PUSH)."""
        self._send(self._frames(msg, None), timeout_ms)

    def send_to(self, identity: bytes, msg: Message, *, timeout_ms: int | None = None) -> None:
        """Send ``msg`` to the peer ``identity`` (ROUTER)."""
        self._send(self._frames(msg, identity), timeout_ms)

    def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, or None after ``timeout_ms`` (DEALER, PULL)."""
        self._check_recv(routed=False)
        return self._message(self._recv_frames(timeout_ms))

    def recv_from(self, timeout_ms: int | None = None) -> tuple[bytes, Message] | None:
        """The next ``(identity, message)``, or None after ``timeout_ms`` (ROUTER)."""
        self._check_recv(routed=True)
        return self._routed(self._recv_frames(timeout_ms))

    def _send(self, frames: list[bytes], timeout_ms: int | None) -> None:
        if timeout_ms is None:
            self._socket.send_multipart(frames)
            return
        if self._socket.poll(timeout_ms, zmq.POLLOUT):
            try:  # the peer that made it writable can go before the send (a refused
                self._socket.send_multipart(frames, flags=zmq.NOBLOCK)  # handshake)
                return
            except zmq.Again:
                pass
        raise TimeoutError(f"{self._name} socket could not send within {timeout_ms} ms")

    def _recv_frames(self, timeout_ms: int | None) -> list[bytes] | None:
        if timeout_ms is not None and not self._socket.poll(timeout_ms, zmq.POLLIN):
            return None
        return list(self._socket.recv_multipart())


class AsyncChannel(_ChannelBase):
    """An asyncio channel over a `zmq.asyncio.Context` socket; same contracts as `Channel`."""

    def __init__(
        self, socket: zmq.asyncio.Socket, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    ) -> None:
        super().__init__(socket, max_frame_bytes=max_frame_bytes)
        self._asocket = socket

    @property
    def socket(self) -> zmq.asyncio.Socket:
        """The wrapped asyncio socket."""
        return self._asocket

    async def __aenter__(self) -> AsyncChannel:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        self.close()

    async def send(self, msg: Message, *, timeout_ms: int | None = None) -> None:
        """Send ``msg`` (DEALER, PUSH)."""
        await self._send(self._frames(msg, None), timeout_ms)

    async def send_to(
        self, identity: bytes, msg: Message, *, timeout_ms: int | None = None
    ) -> None:
        """Send ``msg`` to the peer ``identity`` (ROUTER)."""
        await self._send(self._frames(msg, identity), timeout_ms)

    async def recv(self, timeout_ms: int | None = None) -> Message | None:
        """The next message, or None after ``timeout_ms`` (DEALER, PULL)."""
        self._check_recv(routed=False)
        return self._message(await self._recv_frames(timeout_ms))

    async def recv_from(self, timeout_ms: int | None = None) -> tuple[bytes, Message] | None:
        """The next ``(identity, message)``, or None after ``timeout_ms`` (ROUTER)."""
        self._check_recv(routed=True)
        return self._routed(await self._recv_frames(timeout_ms))

    async def _poll(self, timeout_ms: int, flags: int) -> bool:
        # pyzmq's stubs resolve Socket.poll to the Poller signature; the runtime takes flags.
        events = await self._asocket.poll(timeout_ms, flags)  # type: ignore[call-arg]
        return bool(events)

    async def _send(self, frames: list[bytes], timeout_ms: int | None) -> None:
        if timeout_ms is None:
            await self._asocket.send_multipart(frames)
            return
        try:  # room at once, the common case: no poll (a future and a poller a send)
            await self._asocket.send_multipart(frames, flags=zmq.NOBLOCK)
            return
        except zmq.Again:
            pass  # full: wait up to the timeout for room (sends queued before go first)
        if await self._poll(timeout_ms, zmq.POLLOUT):
            try:  # as in Channel._send: the peer can go between the poll and the send
                await self._asocket.send_multipart(frames, flags=zmq.NOBLOCK)
                return
            except zmq.Again:
                pass
        raise TimeoutError(f"{self._name} socket could not send within {timeout_ms} ms")

    async def _recv_frames(self, timeout_ms: int | None) -> list[bytes] | None:
        if timeout_ms is not None and not await self._poll(timeout_ms, zmq.POLLIN):
            return None
        return list(await self._asocket.recv_multipart())
