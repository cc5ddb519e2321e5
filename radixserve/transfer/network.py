"""Where a KV transfer agent listens, and the address its peers dial.

`TransferNetwork` is one agent's network side:

* **ZMQ** binds its ROUTER socket to ``bind_host`` (a port from ``port_min..port_max``,
  or any free one) and advertises ``tcp://<advertise_host>:<port>`` in its metadata;
* **NIXL** cannot bind an address: UCX listens on network *interfaces*. `ucx_env`
  turns ``bind_host`` into the UCX environment that restricts it: a loopback address
  → the loopback interface, another address → the interface holding it, every
  interface (``0.0.0.0``) → no restriction; and the port range into
  ``UCX_TCP_PORT_RANGE``. Same-host shared-memory transports are not network devices
  and stay available. A ``UCX_*`` variable already in the environment wins (e.g.
  ``UCX_NET_DEVICES=mlx5_0:1,eth0`` for RDMA next to TCP).

The default (``127.0.0.1``, any port) keeps both backends on loopback, as `radixserve
up` needs; containers bind ``0.0.0.0`` and advertise the pod IP or container name.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from dataclasses import dataclass, field

from radixserve.protocol.security import ClusterKeys

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "*", ""})
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address


@dataclass(frozen=True)
class TransferNetwork:
    """Bind address, advertised address and port range of one transfer agent, and the
    cluster's keys when a cluster secret is set (the agent then signs its metadata and
    checks its peers', and the ZMQ agent's sockets use CurveZMQ)."""

    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None  # default: bind_host (this host's name if wildcard)
    port_min: int = 0  # 0 and 0: any free port
    port_max: int = 0
    keys: ClusterKeys | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if (self.port_min == 0) != (self.port_max == 0) or self.port_min > self.port_max:
            raise ValueError(
                f"transfer port range {self.port_min}-{self.port_max}: give both ends "
                "(min <= max) or neither"
            )

    @property
    def advertised(self) -> str:
        return advertise_host(self.bind_host, self.advertise_host)

    @property
    def port_range(self) -> str | None:
        """``min-max`` (UCX's syntax), or None for any free port."""
        return f"{self.port_min}-{self.port_max}" if self.port_min else None

    def ucx_env(self) -> dict[str, str]:
        """The UCX variables that keep NIXL's listeners on ``bind_host``'s interface and
        in the port range; ``ValueError`` if no interface holds ``bind_host``."""
        env: dict[str, str] = {}
        if self.bind_host not in WILDCARD_HOSTS:
            env["UCX_NET_DEVICES"] = interface_of(self.bind_host)
        if self.port_range is not None:
            env["UCX_TCP_PORT_RANGE"] = self.port_range
        return env


def advertise_host(listen_host: str, advertise: str | None) -> str:
    """The host others dial: ``advertise`` if set, else the listen host, or this machine's
    host name when listening on every interface."""
    if advertise:
        return advertise
    if listen_host in WILDCARD_HOSTS:
        return socket.gethostname()
    return listen_host


def url_host(host: str) -> str:
    """``host`` as it goes into a ``tcp://host:port`` URL (IPv6 in brackets)."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def interface_of(host: str) -> str:
    """The network interface holding ``host`` (an address or a name resolving to one):
    the loopback interface for any loopback address. ``ValueError`` if none does."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        try:
            address = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError as exc:
            raise ValueError(f"cannot resolve transfer host {host!r}: {exc}") from None
    addresses = interface_addresses()
    if address.is_loopback:
        return next((name for name, held in addresses.items() if held.is_loopback), "lo")
    for name, held in addresses.items():
        if held == address:
            return name
    raise ValueError(
        f"no network interface holds {address} (interfaces: "
        f"{', '.join(f'{n}={a}' for n, a in addresses.items()) or 'none'}); bind the "
        "transfer agent to one of them, to 0.0.0.0, or set UCX_NET_DEVICES yourself"
    )


def interface_addresses() -> dict[str, ipaddress.IPv4Address]:
    """Each network interface's (primary) IPv4 address, by interface name."""
    out: dict[str, ipaddress.IPv4Address] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            with contextlib.suppress(OSError):  # an interface without an IPv4 address
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
                out[name] = ipaddress.IPv4Address(reply[20:24])
    return out
