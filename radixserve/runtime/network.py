"""A service's addresses: its default name, and where its KV transfer agents listen (the
host others dial: `radixserve.transfer.network.advertise_host`)."""

from __future__ import annotations

from radixserve.protocol.security import keys_from
from radixserve.runtime.settings import ServiceSettings
from radixserve.transfer.network import WILDCARD_HOSTS, TransferNetwork, advertise_host


def default_name(role: str, advertised_host: str, port: int) -> str:
    """``<role>-<port>`` on this machine's loopback address (one machine: ports differ),
    else ``<role>-<host>-<port>`` (replicas of one compose service share the port)."""
    if advertised_host in ("127.0.0.1", "::1", "localhost"):
        return f"{role}-{port}"
    return f"{role}-{advertised_host}-{port}"


def transfer_network(settings: ServiceSettings) -> TransferNetwork:
    """Where the service's KV transfer agents listen and what they advertise: the
    service's own address unless ``transfer_host`` names another."""
    s = settings
    bind = s.transfer_host or s.host
    own = bind == s.host or bind in WILDCARD_HOSTS
    advertise = advertise_host(s.host, s.advertise_host) if own else bind
    return TransferNetwork(bind, advertise, s.transfer_port_min, s.transfer_port_max,
                           keys_from(s.cluster_secret))  # fmt: skip
