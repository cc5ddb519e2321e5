"""What a link says: the handshake on connect (`Hello`, `HelloAck`) and the periodic
liveness every service sends (`Heartbeat`, with its typed `WorkerLoad` and `ServiceStats`).
Part of the protocol of `radixserve.protocol.messages`, which registers them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from radixserve.protocol.fields import (
    COUNT,
    ERROR_TEXT,
    MAX_BLOB_BYTES,
    MAX_ERROR_CHARS,
    MAX_ID_CHARS,
    PEER_NAME,
    ROLE,
    Role,
)
from radixserve.protocol.stats_messages import MetricSpec, ServiceStats, gauge
from radixserve.protocol.wire import (
    BoolSpec,
    BytesSpec,
    IntSpec,
    Message,
    NestedSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

# --- handshake and liveness -----------------------------------------------------------


@dataclass(frozen=True)
class Hello(Message):
    """First message on a connection: who is speaking. ``generation`` grows per restart."""

    TYPE_TAG: ClassVar[str] = "hello"
    name: str = field(metadata=_spec(PEER_NAME))
    role: Role = field(metadata=_spec(ROLE))
    generation: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class HelloAck(Message):
    """Answer to `Hello` with the responder's identity; ``accepted`` False refuses the peer.

    A worker also says what it serves (``model_name``, ``max_model_len``) and its page
    geometry (``page_size``, ``hash_namespace``, ``pool_digest``, and ``tp_size``, the
    ranks its pool is split over: a link whose peer pages differ from its own, or whose
    TP size cannot exchange pages with its own, is refused,
    `radixserve.runtime.page_geometry.PageGeometry`), the ``model_identity`` its pages were
    computed by (`radixserve.model.identity.ModelIdentity.key`; "" from an older worker)
    and, if it owns KV pages peers may read, the agent's opaque
    ``transfer_metadata`` (`KVTransferAgent.metadata`), which the reader checks for a
    compatible pool before its first transfer. A decode worker's ``token_port`` (0:
    none) is its token endpoint's (`radixserve.runtime.token_endpoint`), on the host its
    control socket is reached at: a gateway receives its requests' tokens there.
    """

    TYPE_TAG: ClassVar[str] = "hello_ack"
    name: str = field(metadata=_spec(PEER_NAME))
    role: Role = field(metadata=_spec(ROLE))
    generation: int = field(default=0, metadata=_spec(COUNT))
    accepted: bool = field(default=True, metadata=_spec(BoolSpec()))
    reason: str = field(default="", metadata=_spec(ERROR_TEXT))
    model_name: str = field(default="", metadata=_spec(StrSpec(MAX_ID_CHARS)))
    max_model_len: int = field(default=0, metadata=_spec(COUNT))
    page_size: int = field(default=0, metadata=_spec(COUNT))
    hash_namespace: bytes = field(default=b"", metadata=_spec(BytesSpec(64)))
    pool_digest: str = field(default="", metadata=_spec(StrSpec(64)))
    tp_size: int = field(default=0, metadata=_spec(COUNT))
    transfer_metadata: bytes = field(default=b"", metadata=_spec(BytesSpec(MAX_BLOB_BYTES)))
    model_identity: str = field(default="", metadata=_spec(StrSpec(MAX_ERROR_CHARS)))
    token_port: int = field(default=0, metadata=_spec(IntSpec(0, 65535)))


@dataclass(frozen=True)
class WorkerLoad(WireStruct):
    """The load a service reports in every heartbeat, read by routers and the autoscaler.

    ``queued_tokens``: prompt tokens accepted but not computed yet (a prefill worker's
    whole prompts until their first token; a decode worker's local prefills);
    ``running`` / ``waiting``: requests in the engine's running batch / admission queue;
    ``draining``: the service takes no new requests and leaves once its work is done.
    """

    queued_tokens: int = gauge("Prompt tokens accepted and not computed yet.")
    running: int = gauge("Requests in the engine's running batch.")
    waiting: int = gauge("Requests in the engine's admission queue.")
    draining: bool = field(default=False, metadata={
        "wire": BoolSpec(), "metric": MetricSpec("gauge", "1 while the service drains.")})  # fmt: skip


@dataclass(frozen=True)
class Heartbeat(Message):
    """Periodic liveness, typed load (`WorkerLoad`) and the service's numbers
    (`ServiceStats`: exported as metrics, shown by /debug/cache and the explorer)."""

    TYPE_TAG: ClassVar[str] = "heartbeat"
    sender: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(default=0, metadata=_spec(COUNT))
    load: WorkerLoad = field(default_factory=WorkerLoad, metadata=_spec(NestedSpec(WorkerLoad)))
    stats: ServiceStats = field(
        default_factory=ServiceStats, metadata=_spec(NestedSpec(ServiceStats))
    )
