"""A decode worker's token endpoint: the engine thread sends each step's tokens itself.

Through the control socket a token takes the engine thread's hand-off to the event loop,
the loop's encode and send, and ZMQ's I/O thread: at batch 1 the loop's part is about a
twentieth of a step, on the cores the step runs on. The token endpoint is a second
ROUTER socket of the decode worker (same host, same CURVE keys; its port in the
`HelloAck`, ``token_port``) that the engine thread sends on directly.

Contracts:
- A gateway whose link is up connects one DEALER to it, with the routing id
  `token_routing_id` (its `Hello` name and generation), and only receives on it; the
  worker never reads it. The socket is `ROUTER_MANDATORY`: a send to a gateway that is
  not connected (yet, or any more) fails at once instead of vanishing.
- Every message of a request after its admission travels by one way, in order: its
  `TokenRoute` sends them on the endpoint until a send fails, then on the control
  socket for the rest of the request (``fell_back``, sticky). The engine thread sends
  every output but the last (`TokenRoute.deliver`, called between steps); the last
  output, and `RequestFailed`, are sent by the event loop (`TokenRoute.send`), after
  the engine thread's sends of that request (it hands the last one over after them).
- The socket is used from two threads under one lock, never at the same time; sends
  never block (no high-water mark: a slow gateway queues in memory, as a request's
  tokens are bounded by its ``max_tokens``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq

from radixserve.protocol import Channel, Message
from radixserve.protocol.codec import encode
from radixserve.protocol.security import ClusterKeys

if TYPE_CHECKING:  # the engine's; a gateway imports this module too
    from radixserve.engine.outputs import RequestOutput

logger = logging.getLogger(__name__)


def token_routing_id(name: str, generation: int) -> bytes:
    """The routing id a gateway's token DEALER uses: who it is on the control link."""
    return f"{name}@{generation}".encode()


class TokenEndpoint:
    """The worker's ROUTER for outgoing tokens, shared by the engine thread and the loop."""

    def __init__(self, context: zmq.Context[Any], address: str, keys: ClusterKeys | None) -> None:
        """Bind ``address`` (``tcp://host:0``: a free port, chosen by the bind itself) with
        the control socket's keys, on ``context``'s I/O thread."""
        # a blocking socket on the same I/O thread: the engine thread sends without a loop
        sync: zmq.Context[Any] = zmq.Context.shadow(context.underlying)
        self._channel = Channel.open(sync, zmq.ROUTER, address, bind=True, keys=keys)
        socket = self._channel.socket
        socket.setsockopt(zmq.SNDHWM, 0)
        socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._lock = threading.Lock()
        self.port = int(self._channel.endpoint.rsplit(":", 1)[1])
        self.sent = 0  # messages sent here (read by the worker's stats)

    def send(self, identity: bytes, msg: Message) -> bool:
        """Send ``msg`` to the gateway ``identity``; False if it is not connected or the
        endpoint is closed (from any thread; never blocks)."""
        frame = encode(msg)
        with self._lock:
            if self._channel.closed:
                return False
            try:
                self._channel.socket.send_multipart([identity, frame], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # EHOSTUNREACH: not connected
                return False
            self.sent += 1
        return True

    def close(self) -> None:
        with self._lock:
            self._channel.close()


class TokenRoute:
    """How one request's messages reach its gateway: the token endpoint while it can."""

    def __init__(
        self,
        endpoint: TokenEndpoint,
        identity: bytes,
        to_message: Callable[[RequestOutput], Message],
    ) -> None:
        self.endpoint = endpoint
        self.identity = identity
        self._to_message = to_message
        self.fell_back = False  # a send failed: the rest goes on the control socket

    def deliver(self, output: RequestOutput) -> bool:
        """The engine thread's sink: send a non-final output; False hands it (and every
        later one) to the loop instead."""
        return not self.fell_back and self.send(self._to_message(output))

    def send(self, msg: Message) -> bool:
        """Send one of the request's messages (the loop sends its last one); False: send
        it on the control socket, as every later one goes."""
        if self.fell_back or not self.endpoint.send(self.identity, msg):
            self.fell_back = True
            return False
        return True
