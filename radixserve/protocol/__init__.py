"""The wire protocol between gateway, prefill, decode and kvstore processes.

`messages` defines every message type, `codec` turns them into msgpack frames and back
(validating everything), `channel` carries them over ZMQ sockets.
"""

from radixserve.protocol.channel import AsyncChannel, Channel
from radixserve.protocol.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode, encode
from radixserve.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    GenerateRequest,
    Heartbeat,
    Hello,
    HelloAck,
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostRelease,
    IndexQuery,
    IndexReply,
    KVEvent,
    KVReady,
    KVResync,
    Message,
    PrefillRequest,
    RequestFailed,
    SamplingSpec,
    SpillDone,
    SpillOffer,
    TokenChunk,
    TransferDone,
)

__all__ = [
    "DEFAULT_MAX_FRAME_BYTES",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "Abort",
    "AsyncChannel",
    "Channel",
    "GenerateRequest",
    "Heartbeat",
    "Hello",
    "HelloAck",
    "HostAttach",
    "HostAttachAck",
    "HostLease",
    "HostLookup",
    "HostRelease",
    "IndexQuery",
    "IndexReply",
    "KVEvent",
    "KVReady",
    "KVResync",
    "Message",
    "PrefillRequest",
    "ProtocolError",
    "RequestFailed",
    "SamplingSpec",
    "SpillDone",
    "SpillOffer",
    "TokenChunk",
    "TransferDone",
    "decode",
    "encode",
]
