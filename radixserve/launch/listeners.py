"""Listening sockets bound by the supervisor and inherited by the services.

`radixserve up` never probes for a free port and hands the number on: another process,
or the kernel's next ``bind(..., 0)``, could take it before the service binds it. The
supervisor binds each service's listening socket itself instead, before any process
starts, and keeps it for the cluster's life:

* a `Listener` on port 0 is bound at once: the kernel picks a port no other socket holds,
  and the port is reserved (bound) from then on, so every address (the kvstore's, each
  worker's control socket, the gateway's and the autoscaler's URLs) is known before
  anyone is started or told to connect. Until the service listens, a connection to it
  is refused, as for a service not yet started;
* a `Listener` on a port the user gave (``--port 8000``) is bound, with
  ``SO_REUSEADDR``, and put to listen by `bind()`: `build_cluster` calls it before
  starting anything, so a port in use is an error naming it, not a crash-looping child.

A process gets its socket by file descriptor: its spec (`ProcessSpec.sockets`) names
the setting (``RADIXSERVE_<SERVICE>_LISTEN_FD``) and the supervisor passes the
descriptor (``pass_fds``, or over the warm-start server's socket) with the setting set
to its number. The service calls `adopt` (it listens, with the service's backlog) and
serves on it: ZMQ's ROUTER through ``ZMQ_USE_FD``, uvicorn and asyncio's servers on the
socket itself. A restarted process inherits the same socket, so a service keeps its
port across restarts: the kvstore is found again where the others look, static worker
lists stay right. While a process is down, connections to its port wait in the
socket's backlog until its next incarnation accepts them. The supervisor closes a
listener once its process is retired or the cluster stops.
"""

from __future__ import annotations

import contextlib
import socket

#: the backlog a service listens with (the kernel caps it at net.core.somaxconn)
BACKLOG = 2048


class Listener:
    """One service's listening TCP socket, held by the supervisor."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"a port is 0 to 65535, not {port}")
        self.host = host
        self._given = port  # 0: any free port, bound now
        self._sock: socket.socket | None = None
        self._closed = False
        self.port = port
        if port == 0:
            self.bind()

    def bind(self) -> socket.socket:
        """The socket, bound (and, on a given port, listening); `OSError` naming the
        address if it cannot be."""
        if self._sock is not None:
            return self._sock
        if self._closed:  # its port was told to others: never another one
            raise OSError(f"the listener on {self.host}:{self.port} is closed")
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        # proto TCP, not 0: asyncio sets TCP_NODELAY only on connections whose proto says
        # TCP (and Nagle's delay against the client's delayed ACK is 40 ms a response)
        sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            if self._given:  # a restart of `radixserve up` finds the port in TIME_WAIT
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, self._given))
            if self._given:
                sock.listen(BACKLOG)
        except OSError as exc:
            sock.close()
            raise OSError(exc.errno, f"cannot listen on {self.host}:{self._given}: "
                                     f"{exc.strerror}") from exc  # fmt: skip
        self._sock = sock
        self.port = int(sock.getsockname()[1])
        return sock

    def dup(self) -> Listener:
        """Another handle on the same socket, bound: it stays open when this one closes
        (a process that replaces another, e.g. the kvstore restarted with new settings,
        keeps its port)."""
        twin = Listener.__new__(Listener)
        twin.host, twin._given, twin.port = self.host, self.port, self.port
        twin._sock, twin._closed = self.bind().dup(), False
        return twin

    def fileno(self) -> int:
        """The descriptor a child inherits (bound first if it is not yet)."""
        return self.bind().fileno()

    def close(self) -> None:
        """Close the socket, for good."""
        self._closed = True
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def __repr__(self) -> str:
        return f"Listener({self.host}:{self.port})"


def adopt(fd: int, backlog: int = BACKLOG) -> socket.socket:
    """The listening socket inherited as ``fd``: put to listen and not inherited further
    (by a rank or helper this process starts). The caller owns it."""
    sock = socket.socket(fileno=fd)
    try:
        if sock.type != socket.SOCK_STREAM or sock.family not in (socket.AF_INET,
                                                                  socket.AF_INET6):  # fmt: skip
            raise OSError(f"descriptor {fd} is not a TCP socket")
        sock.set_inheritable(False)
        sock.listen(backlog)
    except OSError:
        sock.detach()
        raise
    return sock


def adopt_fd(fd: int, backlog: int = BACKLOG) -> int:
    """`adopt` for a library that takes a bare descriptor (ZMQ's ``USE_FD``): ``fd``,
    listening; the library closes it."""
    return adopt(fd, backlog).detach()
