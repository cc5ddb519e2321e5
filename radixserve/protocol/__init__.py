"""The wire protocol between gateway, prefill, decode and kvstore processes.

`messages` defines every message type, `codec` turns them into msgpack frames and back
(validating everything), `channel` carries them over ZMQ sockets.
"""

from radixserve.protocol.channel import AsyncChannel, Channel
from radixserve.protocol.codec import DEFAULT_MAX_FRAME_BYTES, ProtocolError, decode, encode
from radixserve.protocol.host_messages import (
    HostAttach,
    HostAttachAck,
    HostLease,
    HostLookup,
    HostPagesReady,
    HostRelease,
    SpillDone,
    SpillOffer,
    SpillRun,
)
from radixserve.protocol.index_messages import (
    Deregister,
    IndexQuery,
    IndexReply,
    KVEvent,
    KVResync,
    MemberInfo,
    MemberList,
    Register,
    WatchMembers,
)
from radixserve.protocol.link_messages import Heartbeat, Hello, HelloAck, WorkerLoad
from radixserve.protocol.messages import (
    MESSAGE_TYPES,
    PROTOCOL_VERSION,
    Abort,
    GenerateRequest,
    KVReady,
    PrefillRequest,
    RequestFailed,
    TokenChunk,
    TransferDone,
)
from radixserve.protocol.sampling import LogprobEntry, SamplingSpec
from radixserve.protocol.wire import Message

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
    "HostPagesReady",
    "HostRelease",
    "IndexQuery",
    "IndexReply",
    "KVEvent",
    "KVReady",
    "KVResync",
    "MemberInfo",
    "MemberList",
    "LogprobEntry",
    "Message",
    "PrefillRequest",
    "ProtocolError",
    "Register",
    "Deregister",
    "RequestFailed",
    "SamplingSpec",
    "SpillDone",
    "SpillOffer",
    "SpillRun",
    "TokenChunk",
    "TransferDone",
    "WatchMembers",
    "WorkerLoad",
    "decode",
    "encode",
]
