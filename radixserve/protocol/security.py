"""The cluster secret: CurveZMQ keys for every control socket and a MAC for transfer metadata.

With a ``cluster_secret`` configured, every service derives the same keys from it
(HKDF-SHA256, one label per key), so nothing but the secret has to be distributed:

* a CURVE server key pair, used by every socket that binds (the services' ROUTER
  sockets, the ZMQ transfer agents), and a CURVE client key pair, used by every socket
  that connects. A peer that does not know the secret cannot complete the handshake
  (it lacks the server's public key), so its frames never reach the application: the
  binding socket's monitor sees the failed handshake, and the service counts it
  (``auth_refused_total``);
* a MAC key: transfer agents sign the metadata they hand out (`sign`) and check what
  they are handed (`open`), so the KV-transfer handshake cannot be forged either.

The secret never travels. Without one, sockets use ZMQ's NULL mechanism (the default
for ``radixserve up`` on loopback).
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from dataclasses import dataclass

import zmq
from pydantic import AliasChoices
from zmq.utils import z85

from radixserve.errors import ConfigurationError

MAC_BYTES = 32
#: the settings field's sources: one variable for every service, whatever its prefix
CLUSTER_SECRET_ALIAS = AliasChoices("cluster_secret", "RADIXSERVE_CLUSTER_SECRET")
_LABELS = (b"radixserve curve server", b"radixserve curve client", b"radixserve mac")


#: example values that documentation and example files carry: refused as secrets and keys
PLACEHOLDERS = frozenset({
    "replace-me-with-openssl-rand-hex-32",
    "changeme", "change-me", "secret", "password",
})  # fmt: skip
SECRET_SETTING = "RADIXSERVE_CLUSTER_SECRET"


def is_placeholder(value: str) -> bool:
    """Whether ``value`` is an example's placeholder rather than a secret of its own."""
    lowered = value.strip().lower()
    return lowered in PLACEHOLDERS or lowered.startswith("replace-me")


def is_loopback(host: str) -> bool:
    """Whether a listen or dial host reaches this machine only (127.0.0.0/8, ::1,
    localhost); a name or every interface (0.0.0.0, ::) is not."""
    name = host.strip("[]")
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def dial_host(address: str) -> str:
    """The host of a ``tcp://host:port`` address (the whole address if it has no scheme)."""
    rest = address.split("://", 1)[-1]
    return rest.rsplit(":", 1)[0] if ":" in rest else rest


class InsecureBindError(ConfigurationError):
    """A service asked to be reachable from other machines without authentication."""


def require_secret(secret: object, exposed: list[str], service: str) -> None:
    """Refuse to start ``service`` when ``exposed`` (its non-loopback listen or dial
    addresses) is not empty and no cluster secret is set."""
    if exposed and keys_from(secret) is None:
        raise InsecureBindError(
            f"{service} would be reachable beyond this machine ({', '.join(exposed)}) with no "
            f"authentication: set {SECRET_SETTING}, the same 16+ character secret for every "
            "service of the cluster (openssl rand -hex 32), or listen on 127.0.0.1"
        )


class AuthError(ValueError):
    """Signed data whose MAC does not verify (another cluster, or tampered with)."""


def _hkdf(secret: bytes, label: bytes) -> bytes:
    """32 bytes for ``label`` from ``secret`` (RFC 5869 with a fixed salt, one block)."""
    prk = hmac.new(b"radixserve cluster secret", secret, hashlib.sha256).digest()
    return hmac.new(prk, label + b"\x01", hashlib.sha256).digest()


@dataclass(frozen=True)
class ClusterKeys:
    """Keys derived from one cluster secret (z85-encoded CURVE keys, a raw MAC key)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes
    mac_key: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKeys:
        if len(secret) < 16:
            raise ValueError("the cluster secret must be at least 16 characters")
        raw = secret.encode()
        server, client, mac = (_hkdf(raw, label) for label in _LABELS)
        server_secret, client_secret = z85.encode(server), z85.encode(client)
        return cls(
            server_public=zmq.curve_public(server_secret),
            server_secret=server_secret,
            client_public=zmq.curve_public(client_secret),
            client_secret=client_secret,
            mac_key=mac,
        )

    def secure(self, socket: zmq.Socket, bind: bool) -> None:
        """Make ``socket`` a CURVE server (it binds) or client (it connects)."""
        if bind:
            socket.setsockopt(zmq.CURVE_SERVER, 1)
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.server_secret)
        else:
            socket.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            socket.setsockopt(zmq.CURVE_PUBLICKEY, self.client_public)
            socket.setsockopt(zmq.CURVE_SECRETKEY, self.client_secret)

    def sign(self, data: bytes) -> bytes:
        """``data`` with its MAC in front."""
        return hmac.new(self.mac_key, data, hashlib.sha256).digest() + data

    def open(self, signed: bytes) -> bytes:
        """The data of ``signed`` once its MAC verifies; `AuthError` if it does not."""
        tag, data = signed[:MAC_BYTES], signed[MAC_BYTES:]
        expected = hmac.new(self.mac_key, data, hashlib.sha256).digest()
        if len(tag) != MAC_BYTES or not hmac.compare_digest(tag, expected):
            raise AuthError("transfer metadata is not signed with this cluster's secret")
        return data


def keys_from(secret: object) -> ClusterKeys | None:
    """The keys of a settings field holding the secret (a pydantic ``SecretStr``, a str
    or None)."""
    if secret is None:
        return None
    value = secret.get_secret_value() if hasattr(secret, "get_secret_value") else str(secret)
    return ClusterKeys.from_secret(value) if value else None


HANDSHAKE_FAILURES = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
