"""Every message type of the wire protocol, with the bounds of each field.

Messages are frozen dataclasses of plain data (no tensors: KV bytes move through the
transfer layer) whose fields carry wire specs (`radixserve.protocol.wire`). Construction
only normalises containers; the codec (`radixserve.protocol.codec`) is the single gate.

Compatibility: `PROTOCOL_VERSION` is `(major, minor)`. Peers must share the major
version. Within a major version, a new field must have a default (old peers omit it) and
decoders ignore keys they do not know (new peers may send them). A new message type
also bumps the minor version: an older peer refuses a type it does not know, so the
minor says which requests (the explorer's cache tree, the audit's clear) it can answer.
4.1 added the disk tier's fields (`disk_cached_tokens`, `HostAttachAck.disk_tier`),
trace context and spans (`traceparent`, `spans`), `TokenChunk.route` /
`prefill_worker`, `SamplingSpec`'s kept special tokens, a host lease still loading
from disk (`HostLookup.reads_loading`, `HostLease.loading` / `ready_pages`), and the
`HostPagesReady`, `CacheTreeQuery` / `CacheTreeReply` and `CacheAuditClear` /
`CacheAuditCleared` messages. 5.0: page hashes are 128-bit, each list of them one bin of
16 bytes per hash (`HashesSpec`); a `SpillOffer` carries its pages' tokens and what their
hashes chain from (`SpillRun`), a `HostLease` the stored tokens of its pages. 5.1: a
request's place among other tenants' for the engines' fair share (`GenerateRequest` and
`PrefillRequest`: ``tenant``, ``priority``, ``tenant_weight``); a 5.0 peer ignores them
and its engine serves every request as one tenant's. 5.2: a
`PrefillRequest` carries its prompt's page hashes, a `KVReady` how long its pages stay
lent (``lease_ms``, which the reader checks before it reads); a reasoning budget (`SamplingSpec`: ``thinking_token_budget``, ``thinking_start_ids``,
``thinking_end_ids``, ``thinking_open``); a 5.1 peer ignores it and lets the model
reason as long as it will. Every message's frame is checked against golden bytes
(`tests/protocol/golden/frames.json`): a wire change fails there until it is written
again with the version.

Flow of the disaggregated design::

    gateway --GenerateRequest--> decode --PrefillRequest--> prefill
    prefill --KVReady--> decode --TransferDone--> prefill        (lease release)
    decode --TokenChunk | RequestFailed--> gateway;  Abort in either direction
    Hello / HelloAck on connect, Heartbeat periodically from every worker
    gateway --CacheTreeQuery--> worker --CacheTreeReply--> gateway  (the explorer's view)

and of the kvstore's host-memory tier (each worker over its link to the kvstore)::

    worker --HostAttach--> kvstore --HostAttachAck-->             (agents meet)
    worker --SpillOffer--> kvstore (reads the staged pages) --SpillDone--> worker
    worker --HostLookup--> kvstore --HostLease--> worker (reads) --HostRelease-->
    (a lease still loading from disk: kvstore --HostPagesReady...--> worker, reading meanwhile)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import ClassVar, Literal, get_args

from radixserve.protocol.sampling import (  # noqa: F401 - re-exported
    LOGPROB_ENTRIES,
    LogprobEntry,
    SamplingSpec,
)
from radixserve.protocol.wire import (  # noqa: F401 - the limits are re-exported
    INT64_MAX,
    MAX_TEXT_CHARS,
    MAX_TOKEN_ID,
    MAX_TOKENS_PER_MESSAGE,
    TOKEN_ID,
    BoolSpec,
    BytesSpec,
    FloatSpec,
    HashesSpec,
    IntSpec,
    ListSpec,
    Message,
    NestedSpec,
    OptionalSpec,
    StatsSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

PROTOCOL_VERSION: tuple[int, int] = (5, 2)

MAX_PAGE_ID = 2**31 - 1
MAX_PAGES_PER_MESSAGE = 1 << 20
MAX_ID_CHARS = 256
MAX_NAME_CHARS = 128
MAX_ERROR_CHARS = 4096
MAX_LOAD_STATS = 256
MAX_BLOB_BYTES = 1 << 20

Role = Literal["gateway", "prefill", "decode", "kvstore"]
ErrorType = Literal["invalid_request", "capacity", "internal", "timeout", "peer_lost", "draining"]
FinishReason = Literal["stop", "length", "abort"]
ROLES: frozenset[str] = frozenset(get_args(Role))
ERROR_TYPES: frozenset[str] = frozenset(get_args(ErrorType))
FINISH_REASONS: frozenset[str] = frozenset(get_args(FinishReason))
ROUTES: frozenset[str] = frozenset({"", "local", "host", "remote"})  # `Admission.route`


COUNT = IntSpec()
REQUEST_ID = StrSpec(MAX_ID_CHARS, min_chars=1)
PEER_NAME = StrSpec(MAX_NAME_CHARS, min_chars=1)
ERROR_TEXT = StrSpec(MAX_ERROR_CHARS)
DURATION_MS = FloatSpec()
TOKEN_IDS = ListSpec(TOKEN_ID, MAX_TOKENS_PER_MESSAGE)
PROMPT_IDS = ListSpec(TOKEN_ID, MAX_TOKENS_PER_MESSAGE, min_len=1)
PAGE_HASHES = HashesSpec(MAX_PAGES_PER_MESSAGE)  # 128-bit hashes, 16 bytes each
PARENT_HASH = HashesSpec(1)  # a page's parent: none (the first page) or one hash
NAMESPACE = BytesSpec(64)
ROLE = StrSpec(MAX_NAME_CHARS, choices=ROLES)
LOAD_STATS = StatsSpec(
    MAX_LOAD_STATS, StrSpec(MAX_NAME_CHARS, 1), IntSpec(-INT64_MAX), FloatSpec(-1e300, 1e300)
)


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
    `radixserve.runtime.links.PageGeometry`), the ``model_identity`` its pages were
    computed by (`radixserve.model.identity.ModelIdentity.key`; "" from an older worker)
    and, if it owns KV pages peers may read, the agent's opaque
    ``transfer_metadata`` (`KVTransferAgent.metadata`), which the reader checks for a
    compatible pool before its first transfer.
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


@dataclass(frozen=True)
class WorkerLoad(WireStruct):
    """The load a service reports in every heartbeat, read by routers and the autoscaler.

    ``queued_tokens``: prompt tokens accepted but not computed yet (a prefill worker's
    whole prompts until their first token; a decode worker's local prefills);
    ``running`` / ``waiting``: requests in the engine's running batch / admission queue;
    ``draining``: the service takes no new requests and leaves once its work is done.
    """

    queued_tokens: int = field(default=0, metadata=_spec(COUNT))
    running: int = field(default=0, metadata=_spec(COUNT))
    waiting: int = field(default=0, metadata=_spec(COUNT))
    draining: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class Heartbeat(Message):
    """Periodic liveness, typed load (`WorkerLoad`) and counters for metrics (``stats``,
    e.g. ``{"pages_free": 100, "kv_transfer_bytes_total": 4096}``; read by nothing but
    metrics and /debug/cache)."""

    TYPE_TAG: ClassVar[str] = "heartbeat"
    sender: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(default=0, metadata=_spec(COUNT))
    load: WorkerLoad = field(default_factory=WorkerLoad, metadata=_spec(NestedSpec(WorkerLoad)))
    stats: Mapping[str, int | float] = field(
        default_factory=lambda: MappingProxyType({}), metadata=_spec(LOAD_STATS)
    )


# --- tracing: spans carried back to the gateway ---------------------------------------

MAX_SPANS_PER_MESSAGE = 64
MAX_SPAN_LABELS = 16
SPAN_ID = StrSpec(16, min_chars=16)  # 16 lowercase hex digits (W3C trace context)
TRACEPARENT = StrSpec(55)  # a W3C ``traceparent`` (version 00), "" when not traced
# whose KV a request may share (`radixserve.cache.block_hash.cache_scope`); "" = default
CACHE_SCOPE = StrSpec(1024)
# a request's place among other tenants' (`radixserve.engine.fair_share.TenantShare`): its
# tenant (an opaque id, "" = the default), priority (lower = sooner) and tenant's weight
TENANT_ID = StrSpec(64)
MAX_PRIORITY = 100
PRIORITY = IntSpec(-MAX_PRIORITY, MAX_PRIORITY)
MIN_TENANT_WEIGHT = 0.01
MAX_TENANT_WEIGHT = 1000.0
TENANT_WEIGHT = FloatSpec(MIN_TENANT_WEIGHT, MAX_TENANT_WEIGHT)
SPAN_STATUSES: frozenset[str] = frozenset({"unset", "ok", "error"})


@dataclass(frozen=True)
class SpanLabel(WireStruct):
    """One text attribute of a span (a worker's name, a route); numbers go in ``values``."""

    key: str = field(metadata=_spec(StrSpec(MAX_NAME_CHARS, 1)))
    value: str = field(default="", metadata=_spec(StrSpec(MAX_NAME_CHARS)))


@dataclass(frozen=True)
class SpanRecord(WireStruct):
    """A finished span of a worker, carried back on the request's replies (`KVReady`,
    the last `TokenChunk`) so the gateway keeps whole traces without a tracing backend
    (`radixserve.tracing`). Its trace is the request's; times are unix nanoseconds."""

    span_id: str = field(metadata=_spec(SPAN_ID))
    parent_span_id: str = field(metadata=_spec(SPAN_ID))
    name: str = field(metadata=_spec(StrSpec(MAX_NAME_CHARS, 1)))
    service: Role = field(metadata=_spec(ROLE))
    start_ns: int = field(metadata=_spec(COUNT))
    end_ns: int = field(metadata=_spec(COUNT))
    status: str = field(default="unset", metadata=_spec(StrSpec(8, choices=SPAN_STATUSES)))
    values: Mapping[str, int | float] = field(
        default_factory=lambda: MappingProxyType({}), metadata=_spec(LOAD_STATS)
    )
    labels: tuple[SpanLabel, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(SpanLabel), MAX_SPAN_LABELS))
    )


SPAN_RECORDS = ListSpec(NestedSpec(SpanRecord), MAX_SPANS_PER_MESSAGE)


# --- request flow ---------------------------------------------------------------------


@dataclass(frozen=True)
class GenerateRequest(Message):
    """Gateway -> decode worker: a tokenised prompt to serve. The decode worker alone
    decides how its KV is made (here, from the host tier, or on which prefill worker)."""

    TYPE_TAG: ClassVar[str] = "generate_request"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    prompt_token_ids: tuple[int, ...] = field(metadata=_spec(PROMPT_IDS))
    sampling: SamplingSpec = field(
        default_factory=SamplingSpec, metadata=_spec(NestedSpec(SamplingSpec))
    )
    # the chained hashes of the prompt's full pages (`radixserve.cache.block_hash`), as
    # the gateway computed them to route it: the decode worker does not hash it again
    page_hashes: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_HASHES))
    # a stream migrated from a worker that died: the tokens it already streamed, after
    # which this worker continues (`Engine.admit(resume=)`)
    resume_token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))
    # the gateway's request span (`radixserve.tracing`): the decode worker's spans are its
    # children; "" = not traced
    traceparent: str = field(default="", metadata=_spec(TRACEPARENT))
    # the scope its KV is cached and matched in; ``page_hashes`` are in its namespace
    cache_scope: str = field(default="", metadata=_spec(CACHE_SCOPE))
    # its place among other tenants' requests in the engine's scheduler
    tenant: str = field(default="", metadata=_spec(TENANT_ID))
    priority: int = field(default=0, metadata=_spec(PRIORITY))
    tenant_weight: float = field(default=1.0, metadata=_spec(TENANT_WEIGHT))


@dataclass(frozen=True)
class PrefillRequest(Message):
    """Decode -> prefill worker: compute the prompt past the decode side's cached prefix.

    The decode worker already holds the first ``num_cached_tokens`` tokens (page-aligned);
    the prefill worker computes the prompt, samples the first token and answers
    `KVReady` naming its pages past them; the decode worker then reads those into its
    ``dst_page_ids`` (one per page) through its transfer agent.
    """

    TYPE_TAG: ClassVar[str] = "prefill_request"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    token_ids: tuple[int, ...] = field(metadata=_spec(PROMPT_IDS))
    dst_page_ids: tuple[int, ...] = field(
        metadata=_spec(ListSpec(IntSpec(0, MAX_PAGE_ID), MAX_PAGES_PER_MESSAGE))
    )
    sampling: SamplingSpec = field(
        default_factory=SamplingSpec, metadata=_spec(NestedSpec(SamplingSpec))
    )
    num_cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    traceparent: str = field(default="", metadata=_spec(TRACEPARENT))  # the decode side's span
    cache_scope: str = field(default="", metadata=_spec(CACHE_SCOPE))  # the request's
    tenant: str = field(default="", metadata=_spec(TENANT_ID))  # the request's, as above
    priority: int = field(default=0, metadata=_spec(PRIORITY))
    tenant_weight: float = field(default=1.0, metadata=_spec(TENANT_WEIGHT))
    # the chained hashes of the prompt's full pages in its scope's namespace (the
    # gateway's, as the decode worker got them): its host-tier lookup hashes nothing again
    page_hashes: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_HASHES))

    def invariant_error(self) -> str | None:
        if len(self.page_hashes) > len(self.token_ids):
            return f"{len(self.page_hashes)} page hashes for {len(self.token_ids)} tokens"
        if self.num_cached_tokens >= len(self.token_ids):
            return (
                f"num_cached_tokens={self.num_cached_tokens} must be below "
                f"len(token_ids)={len(self.token_ids)} (the last token is always computed)"
            )
        return None


@dataclass(frozen=True)
class KVReady(Message):
    """Prefill -> decode worker: the prompt's KV is computed and the first token is known.

    ``first_token_ids`` holds every choice's first token, in choice order (one for n = 1).
    ``src_page_ids`` names the prefill worker's pages holding the prompt past the decode
    side's ``num_cached_tokens``, leased until the decode worker, having read them,
    sends ``TransferDone`` (or the lease ends: ``lease_ms`` after this was sent; None
    from a peer that does not say). A reader starts no read the lease has run out for.
    """

    TYPE_TAG: ClassVar[str] = "kv_ready"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    first_token_ids: tuple[int, ...] = field(
        metadata=_spec(ListSpec(TOKEN_ID, MAX_TOKENS_PER_MESSAGE, min_len=1))
    )
    src_page_ids: tuple[int, ...] = field(
        default=(), metadata=_spec(ListSpec(IntSpec(0, MAX_PAGE_ID), MAX_PAGES_PER_MESSAGE))
    )
    cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    host_cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    first_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    prompt_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    disk_cached_tokens: int = field(default=0, metadata=_spec(COUNT))  # of host_cached_tokens
    spans: tuple[SpanRecord, ...] = field(default=(), metadata=_spec(SPAN_RECORDS))  # traced
    lease_ms: float | None = field(default=None, metadata=_spec(OptionalSpec(DURATION_MS)))


@dataclass(frozen=True)
class TransferDone(Message):
    """Decode -> prefill worker: the transfer is consumed; release its page lease."""

    TYPE_TAG: ClassVar[str] = "transfer_done"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    ok: bool = field(default=True, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class TokenChunk(Message):
    """Decode worker -> gateway: new tokens of one choice (``index``) of a request; a
    choice's last chunk has ``finish_reason``, the request's last also ``finished``."""

    TYPE_TAG: ClassVar[str] = "token_chunk"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))
    text: str = field(default="", metadata=_spec(StrSpec(MAX_TEXT_CHARS)))
    finished: bool = field(default=False, metadata=_spec(BoolSpec()))
    finish_reason: FinishReason | None = field(
        default=None, metadata=_spec(OptionalSpec(StrSpec(16, choices=FINISH_REASONS)))
    )
    prompt_tokens: int = field(default=0, metadata=_spec(COUNT))
    cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    completion_tokens: int = field(default=0, metadata=_spec(COUNT))
    ttft_ms: float | None = field(default=None, metadata=_spec(OptionalSpec(DURATION_MS)))
    host_cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    index: int = field(default=0, metadata=_spec(IntSpec(0, 2**31 - 1)))
    logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    prompt_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    disk_cached_tokens: int = field(default=0, metadata=_spec(COUNT))  # of host_cached_tokens
    # on the request's last chunk: how the decode worker got its prompt's KV (computed
    # here, loaded from the host tier, or computed by the prefill worker ``prefill_worker``)
    route: str = field(default="", metadata=_spec(StrSpec(16, choices=ROUTES)))
    prefill_worker: str = field(default="", metadata=_spec(StrSpec(MAX_NAME_CHARS)))
    # on the request's last chunk when it is traced: the workers' finished spans
    spans: tuple[SpanRecord, ...] = field(default=(), metadata=_spec(SPAN_RECORDS))

    def invariant_error(self) -> str | None:
        if self.finished and self.finish_reason is None:
            return f"a finished chunk must have a finish_reason (finished={self.finished})"
        if self.logprobs and len(self.logprobs) != len(self.token_ids):
            return (
                f"logprobs must have one entry per token ({len(self.logprobs)} for "
                f"{len(self.token_ids)} tokens)"
            )
        return None


@dataclass(frozen=True)
class Abort(Message):
    """Stop serving a request (client gone, timeout); either direction."""

    TYPE_TAG: ClassVar[str] = "abort"
    request_id: str = field(metadata=_spec(REQUEST_ID))


@dataclass(frozen=True)
class RequestFailed(Message):
    """A request ended in error; ``error_type`` maps to the HTTP status at the gateway."""

    TYPE_TAG: ClassVar[str] = "request_failed"
    request_id: str = field(metadata=_spec(REQUEST_ID))
    error_type: ErrorType = field(metadata=_spec(StrSpec(32, choices=ERROR_TYPES)))
    message: str = field(default="", metadata=_spec(ERROR_TEXT))


# --- the kvstore: cluster-wide index of cached pages ---------------------------------

KV_EVENT_KINDS: frozenset[str] = frozenset({"stored", "removed", "cleared"})


@dataclass(frozen=True)
class KVEvent(Message):
    """Worker -> kvstore: pages entered (``stored``) or left (``removed``) its device cache,
    or it dropped everything (``cleared``). ``seq`` counts this worker's events from 1 per
    generation; a gap tells the kvstore it missed some and must resync the worker."""

    TYPE_TAG: ClassVar[str] = "kv_event"
    worker: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(metadata=_spec(COUNT))
    seq: int = field(metadata=_spec(IntSpec(1)))
    kind: str = field(metadata=_spec(StrSpec(16, choices=KV_EVENT_KINDS)))
    page_hashes: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_HASHES))


@dataclass(frozen=True)
class KVResync(Message):
    """Kvstore -> worker: send ``cleared`` and then every cached page as ``stored``."""

    TYPE_TAG: ClassVar[str] = "kv_resync"
    reason: str = field(default="", metadata=_spec(ERROR_TEXT))


@dataclass(frozen=True)
class IndexQuery(Message):
    """Anyone -> kvstore: which workers hold how long a prefix of these chained page
    hashes (the pages of a prompt, `radixserve.cache.block_hash.page_hashes`)?"""

    TYPE_TAG: ClassVar[str] = "index_query"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))


@dataclass(frozen=True)
class IndexReply(Message):
    """Kvstore -> asker: leading pages of the query each worker holds on device (workers
    with 0 left out), and ``host_pages``: leading pages any worker can load from the
    kvstore's tiers (host memory, or disk, promoted through host memory)."""

    TYPE_TAG: ClassVar[str] = "index_reply"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    device_pages: Mapping[str, int | float] = field(
        default_factory=lambda: MappingProxyType({}), metadata=_spec(LOAD_STATS)
    )
    host_pages: int = field(default=0, metadata=_spec(COUNT))


# --- membership: which services make up the cluster ----------------------------------

MAX_MEMBERS = 4096


@dataclass(frozen=True)
class MemberInfo(WireStruct):
    """One service of the cluster as the kvstore's registry knows it: reachable at
    ``address`` (its control socket, as others must dial it)."""

    name: str = field(metadata=_spec(PEER_NAME))
    role: Role = field(metadata=_spec(ROLE))
    address: str = field(metadata=_spec(StrSpec(MAX_NAME_CHARS * 2, min_chars=1)))
    generation: int = field(default=0, metadata=_spec(COUNT))
    draining: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class Register(Message):
    """Service -> kvstore: ``member`` is in the cluster (sent on connecting and whenever
    its state changes, e.g. when it starts draining)."""

    TYPE_TAG: ClassVar[str] = "register"
    member: MemberInfo = field(metadata=_spec(NestedSpec(MemberInfo)))


@dataclass(frozen=True)
class Deregister(Message):
    """Service -> kvstore: it leaves the cluster now (its drain is done)."""

    TYPE_TAG: ClassVar[str] = "deregister"
    name: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class WatchMembers(Message):
    """Anyone -> kvstore: send me the members of these ``roles`` now and on every change."""

    TYPE_TAG: ClassVar[str] = "watch_members"
    roles: tuple[str, ...] = field(default=(), metadata=_spec(ListSpec(ROLE, 8)))


@dataclass(frozen=True)
class MemberList(Message):
    """Kvstore -> watcher: every registered member of the watched roles. ``epoch`` is the
    kvstore's generation (a new one starts with an empty registry that fills as services
    register again); ``version`` grows with every change within an epoch."""

    TYPE_TAG: ClassVar[str] = "member_list"
    epoch: int = field(metadata=_spec(COUNT))
    version: int = field(metadata=_spec(COUNT))
    members: tuple[MemberInfo, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(MemberInfo), MAX_MEMBERS))
    )


# --- the kvstore's host-memory tier ---------------------------------------------------

PAGE_IDS = ListSpec(IntSpec(0, MAX_PAGE_ID), MAX_PAGES_PER_MESSAGE)


@dataclass(frozen=True)
class HostAttach(Message):
    """Worker -> kvstore: join the host tier. ``metadata`` is the worker's spill buffer
    agent (`KVTransferAgent.metadata`): the kvstore reads spilled pages from it."""

    TYPE_TAG: ClassVar[str] = "host_attach"
    worker: str = field(metadata=_spec(PEER_NAME))
    generation: int = field(metadata=_spec(COUNT))
    metadata: bytes = field(metadata=_spec(BytesSpec(MAX_BLOB_BYTES)))


@dataclass(frozen=True)
class HostAttachAck(Message):
    """Kvstore -> worker: ``accepted`` with the host pool's agent ``metadata`` (the worker
    reads host pages from it), or refused with ``reason`` (no tier, other model...).
    ``disk_tier``: a lookup may read pages from the kvstore's disk tier first (the
    worker then waits for it as long as computing those pages would take)."""

    TYPE_TAG: ClassVar[str] = "host_attach_ack"
    accepted: bool = field(metadata=_spec(BoolSpec()))
    metadata: bytes = field(default=b"", metadata=_spec(BytesSpec(MAX_BLOB_BYTES)))
    num_pages: int = field(default=0, metadata=_spec(COUNT))
    reason: str = field(default="", metadata=_spec(ERROR_TEXT))
    disk_tier: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class SpillRun(WireStruct):
    """``num_pages`` consecutive pages of a `SpillOffer`, chained from ``parent`` (empty:
    the first of them starts a sequence) in ``namespace``: what the kvstore recomputes
    their hashes from, with their tokens."""

    num_pages: int = field(metadata=_spec(IntSpec(1, MAX_PAGES_PER_MESSAGE)))
    namespace: bytes = field(metadata=_spec(NAMESPACE))
    parent: tuple[int, ...] = field(default=(), metadata=_spec(PARENT_HASH))


@dataclass(frozen=True)
class SpillOffer(Message):
    """Worker -> kvstore: pages it evicted (or writes through), staged in its spill buffer
    at ``buffer_page_ids``, one per chained hash; the kvstore copies those it lacks.
    ``token_ids``: every page's tokens (page size each), and ``runs`` what their hashes
    chain from: the kvstore stores only pages whose hash it recomputes from them."""

    TYPE_TAG: ClassVar[str] = "spill_offer"
    spill_id: int = field(metadata=_spec(IntSpec(1)))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))
    buffer_page_ids: tuple[int, ...] = field(metadata=_spec(PAGE_IDS))
    token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))
    runs: tuple[SpillRun, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(SpillRun), MAX_PAGES_PER_MESSAGE))
    )

    def invariant_error(self) -> str | None:
        if len(self.page_hashes) != len(self.buffer_page_ids):
            return (
                f"{len(self.page_hashes)} page hashes for {len(self.buffer_page_ids)} buffer pages"
            )
        if self.runs and sum(run.num_pages for run in self.runs) != len(self.page_hashes):
            return (
                f"runs of {sum(r.num_pages for r in self.runs)} pages for {len(self.page_hashes)}"
            )
        if self.page_hashes and len(self.token_ids) % len(self.page_hashes):
            return f"{len(self.token_ids)} tokens for {len(self.page_hashes)} pages"
        return None


@dataclass(frozen=True)
class SpillDone(Message):
    """Kvstore -> worker: done with spill ``spill_id``'s buffer pages (reuse them);
    ``stored`` new pages entered the host tier."""

    TYPE_TAG: ClassVar[str] = "spill_done"
    spill_id: int = field(metadata=_spec(IntSpec(1)))
    stored: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class HostLookup(Message):
    """Worker -> kvstore: lease the longest leading run of these chained page hashes held
    in the host tier (the pages of a prompt past the worker's own device hit). Pages on
    the disk tier are read into host memory first when that is quicker than the worker
    computing them at its measured ``prefill_tokens_per_s`` (0: not measured yet).
    ``reads_loading``: the worker can take a ``loading`` lease (`HostPagesReady`); a
    worker that does not say so gets its lease once every page is in host memory."""

    TYPE_TAG: ClassVar[str] = "host_lookup"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    page_hashes: tuple[int, ...] = field(metadata=_spec(PAGE_HASHES))
    prefill_tokens_per_s: float = field(default=0.0, metadata=_spec(FloatSpec(0.0, 1e12)))
    reads_loading: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class HostLease(Message):
    """Kvstore -> worker: host pages holding the first ``len(host_page_ids)`` queried
    pages, kept until `HostRelease` (or the lease expires); lease 0 = nothing found.
    ``disk_pages`` of them are read from the disk tier for this lookup. With ``loading``
    that read is still under way: only the first ``ready_pages`` may be read now, and
    `HostPagesReady` messages say when more may (the worker reads those meanwhile).
    ``token_ids``: the tokens the tier stored with those pages (page size each), which
    the worker checks against its prompt before it uses any of them."""

    TYPE_TAG: ClassVar[str] = "host_lease"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    lease_id: int = field(default=0, metadata=_spec(COUNT))
    host_page_ids: tuple[int, ...] = field(default=(), metadata=_spec(PAGE_IDS))
    disk_pages: int = field(default=0, metadata=_spec(COUNT))
    loading: bool = field(default=False, metadata=_spec(BoolSpec()))
    ready_pages: int = field(default=0, metadata=_spec(COUNT))
    token_ids: tuple[int, ...] = field(default=(), metadata=_spec(TOKEN_IDS))


@dataclass(frozen=True)
class HostPagesReady(Message):
    """Kvstore -> worker: of a ``loading`` lease, the first ``ready_pages`` hold their KV
    now; ``failed``: the page after them could not be read from disk, and no more come
    (the worker computes the prompt)."""

    TYPE_TAG: ClassVar[str] = "host_pages_ready"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    ready_pages: int = field(metadata=_spec(COUNT))
    failed: bool = field(default=False, metadata=_spec(BoolSpec()))


@dataclass(frozen=True)
class HostRelease(Message):
    """Worker -> kvstore: done reading a lease's pages."""

    TYPE_TAG: ClassVar[str] = "host_release"
    lease_id: int = field(metadata=_spec(IntSpec(1)))


# --- the operator's view: a worker's radix tree and live requests --------------------

MAX_TREE_NODES = 1024
MAX_NODE_TEXT_TOKENS = 64
MAX_IDS_PER_NODE = 16
REQUEST_PHASES: frozenset[str] = frozenset(
    {"queued", "host_load", "awaiting_kv", "prefill", "decode", "leased"}
)
REQUEST_IDS = ListSpec(REQUEST_ID, MAX_IDS_PER_NODE)


@dataclass(frozen=True)
class CacheNodeView(WireStruct):
    """One node of a worker's radix tree as the explorer draws it. ``num_tokens``: its
    own run of tokens, ``prefix_tokens``: the prefix it ends; ``subtree_pages``: pages
    held by it and its descendants; ``locks``: its lock count (`RadixNode.lock_ref`);
    ``last_hit_s``: wall-clock time of its latest hit (0: none); ``text``: its first
    tokens as text, empty unless the asker asked for text; ``recent_request_ids`` /
    ``live_request_ids``: requests whose cached prefix ended at or below it, latest
    first / requests running from it now."""

    node_id: int = field(metadata=_spec(COUNT))
    parent_id: int = field(default=0, metadata=_spec(COUNT))  # 0: a child of the root
    num_tokens: int = field(default=0, metadata=_spec(COUNT))
    prefix_tokens: int = field(default=0, metadata=_spec(COUNT))
    num_pages: int = field(default=0, metadata=_spec(COUNT))
    subtree_pages: int = field(default=0, metadata=_spec(COUNT))
    hits: int = field(default=0, metadata=_spec(COUNT))
    locks: int = field(default=0, metadata=_spec(COUNT))
    last_hit_s: float = field(default=0.0, metadata=_spec(FloatSpec(0.0, 1e13)))
    text: str = field(default="", metadata=_spec(StrSpec(MAX_NODE_TEXT_TOKENS * 64)))
    recent_request_ids: tuple[str, ...] = field(default=(), metadata=_spec(REQUEST_IDS))
    live_request_ids: tuple[str, ...] = field(default=(), metadata=_spec(REQUEST_IDS))


@dataclass(frozen=True)
class LiveRequestView(WireStruct):
    """A request a worker holds now and its phase: ``queued`` (waiting for a step),
    ``host_load`` (reading host-tier pages), ``awaiting_kv`` (a prefill worker computes
    its prompt), ``prefill`` / ``decode`` (running), ``leased`` (a prefill worker's
    pages kept for the decode worker's read)."""

    request_id: str = field(metadata=_spec(REQUEST_ID))
    phase: str = field(metadata=_spec(StrSpec(16, choices=REQUEST_PHASES)))
    prompt_tokens: int = field(default=0, metadata=_spec(COUNT))
    computed_tokens: int = field(default=0, metadata=_spec(COUNT))
    cached_tokens: int = field(default=0, metadata=_spec(COUNT))
    output_tokens: int = field(default=0, metadata=_spec(COUNT))


@dataclass(frozen=True)
class CacheTreeQuery(Message):
    """Gateway -> worker: describe your radix tree (its ``max_nodes`` largest nodes; 0:
    none) and your live requests. ``text_tokens`` > 0 asks for each node's first tokens
    as text (only where the gateway's operator allows prompt text to be shown)."""

    TYPE_TAG: ClassVar[str] = "cache_tree_query"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    max_nodes: int = field(default=0, metadata=_spec(IntSpec(0, MAX_TREE_NODES)))
    text_tokens: int = field(default=0, metadata=_spec(IntSpec(0, MAX_NODE_TEXT_TOKENS)))


@dataclass(frozen=True)
class CacheTreeReply(Message):
    """Worker -> gateway: the answer to `CacheTreeQuery` ``query_id``: the chosen nodes
    (parents before children), the tree's totals (``num_nodes`` 0 when no node was
    asked for), the live requests (at most ``MAX_TREE_NODES``, ``num_live`` in all)."""

    TYPE_TAG: ClassVar[str] = "cache_tree_reply"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    nodes: tuple[CacheNodeView, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(CacheNodeView), MAX_TREE_NODES))
    )
    num_nodes: int = field(default=0, metadata=_spec(COUNT))
    cached_pages: int = field(default=0, metadata=_spec(COUNT))
    requests: tuple[LiveRequestView, ...] = field(
        default=(), metadata=_spec(ListSpec(NestedSpec(LiveRequestView), MAX_TREE_NODES))
    )
    num_live: int = field(default=0, metadata=_spec(COUNT))


# --- the cache audit: an operator's all-clear ----------------------------------------


@dataclass(frozen=True)
class CacheAuditClear(Message):
    """Gateway -> worker: an operator cleared the cache audit; a worker that failed
    closed (`Engine.clear_audit`) drops its cached pages and serves from its cache again."""

    TYPE_TAG: ClassVar[str] = "cache_audit_clear"
    query_id: str = field(metadata=_spec(REQUEST_ID))


@dataclass(frozen=True)
class CacheAuditCleared(Message):
    """Worker -> gateway: `CacheAuditClear` ``query_id`` is done; ``was_failed``: the
    worker had failed closed until then."""

    TYPE_TAG: ClassVar[str] = "cache_audit_cleared"
    query_id: str = field(metadata=_spec(REQUEST_ID))
    was_failed: bool = field(default=False, metadata=_spec(BoolSpec()))


# every message type: the classes above, each a direct subclass of `Message` (checked
# when the registry is built: a tag missing or used twice is an import-time error)
ALL_MESSAGES: tuple[type[Message], ...] = tuple(Message.__subclasses__())


def _build_registry() -> Mapping[str, type[Message]]:
    registry: dict[str, type[Message]] = {}
    for cls in ALL_MESSAGES:
        if not cls.TYPE_TAG or cls.TYPE_TAG in registry:
            raise RuntimeError(f"message {cls.__name__} needs a unique TYPE_TAG")
        registry[cls.TYPE_TAG] = cls
    return MappingProxyType(registry)


MESSAGE_TYPES: Mapping[str, type[Message]] = _build_registry()
"""Type tag -> message class: the registry `decode` dispatches on (read-only)."""
