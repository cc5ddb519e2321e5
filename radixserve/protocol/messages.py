"""Every message type of the wire protocol, with the bounds of each field.

The request flow and its spans are defined here; the handshake and liveness in
`link_messages`, the kvstore's index and the membership in `index_messages`, the host
tier's in `host_messages`, a worker's reads of another's pages in `peer_messages`, the
operator's view in `view_messages`, LoRA adapters in `lora_messages`, the limits and
field specs they share in `fields`: every message type is registered here
(`MESSAGE_TYPES`); each is imported from its own module.

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
reason as long as it will. 6.0: a prompt's cache hits are one `CachedTokens` by tier
(``cached``) on `KVReady`, `TokenChunk` and `LiveRequestView`, replacing
``cached_tokens`` / ``host_cached_tokens`` / ``disk_cached_tokens``; a `Heartbeat`'s ``stats`` are typed
(`ServiceStats`, `radixserve.protocol.stats_messages`), no longer a map of names. 6.1: LoRA
adapters (`radixserve.protocol.lora_messages`): a request's ``adapter`` and its
``adapter_fingerprint`` on `GenerateRequest` and `PrefillRequest`, the fingerprint its pages
were computed with on `KVReady` (the reader refuses pages of another), a worker's adapters in
its heartbeat (`ServiceStats.loras`) with its adapter slots (`EngineSection`'s ``lora_*``),
and `LoraLoad` / `LoraUnload` / `LoraReply`; a 6.0
peer ignores them and serves the base model, whose `KVReady` (no fingerprint) a 6.1 reader
of an adapter's request refuses. 6.2: a worker reads another's cached pages
(`radixserve.protocol.peer_messages`: `PeerRead` / `PeerPages`; every worker's `HelloAck`
carries its transfer metadata) and `CachedTokens` counts them (``peer``); a 6.1 worker
refuses a `PeerRead`, which its reader computes. 6.3: the cache index sharded over several
kvstores (`IndexQuery`: ``shard``, ``shards``); a 6.2 kvstore ignores them and answers each
worker's leading run, never more than it holds. 6.4: a worker's peer-read counters say
how it connected to its peers (`PeerReadSection`: ``peer_connects_total``,
``peer_read_connects_total``); a 6.3 reader of heartbeats ignores them. 6.5: a decode
worker's token endpoint (`HelloAck.token_port`, `DecodeSection`'s ``token_*`` counters);
a 6.4 gateway ignores the port and gets its tokens on the control socket, as before. Every message's
frame is checked against golden bytes (`tests/protocol/golden/frames.json`): a wire change fails there until it is written
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
from typing import ClassVar

from radixserve.protocol import (  # noqa: F401 - their messages are registered below
    host_messages,
    index_messages,
    link_messages,
    peer_messages,
    view_messages,
)
from radixserve.protocol.cached_tokens import CACHED, CachedTokens
from radixserve.protocol.fields import (
    CACHE_SCOPE,
    COUNT,
    DURATION_MS,
    ERROR_TEXT,
    ERROR_TYPES,
    FINISH_REASONS,
    LOAD_STATS,
    MAX_NAME_CHARS,
    MAX_PAGE_ID,
    MAX_PAGES_PER_MESSAGE,
    PAGE_HASHES,
    PROMPT_IDS,
    REQUEST_ID,
    ROLE,
    ROUTES,
    TOKEN_IDS,
    ErrorType,
    FinishReason,
    Role,
)
from radixserve.protocol.lora_messages import ADAPTER_NAME, FINGERPRINT
from radixserve.protocol.sampling import LOGPROB_ENTRIES, LogprobEntry, SamplingSpec
from radixserve.protocol.wire import (
    MAX_TEXT_CHARS,
    MAX_TOKENS_PER_MESSAGE,
    TOKEN_ID,
    BoolSpec,
    FloatSpec,
    IntSpec,
    ListSpec,
    Message,
    NestedSpec,
    OptionalSpec,
    StrSpec,
    WireStruct,
)
from radixserve.protocol.wire import field_spec as _spec

PROTOCOL_VERSION: tuple[int, int] = (6, 5)

# --- tracing: spans carried back to the gateway ---------------------------------------

MAX_SPANS_PER_MESSAGE = 64
MAX_SPAN_LABELS = 16
SPAN_ID = StrSpec(16, min_chars=16)  # 16 lowercase hex digits (W3C trace context)
TRACEPARENT = StrSpec(55)  # a W3C ``traceparent`` (version 00), "" when not traced
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
    # the LoRA adapter it runs with ("" = the base model) and that adapter's fingerprint as
    # the gateway routed it (``page_hashes`` are in its namespace; a worker whose adapter of
    # that name has another fingerprint hashes the prompt itself)
    adapter: str = field(default="", metadata=_spec(ADAPTER_NAME))
    adapter_fingerprint: str = field(default="", metadata=_spec(FINGERPRINT))


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
    # the request's LoRA adapter ("" = the base model) and the fingerprint the decode
    # worker's adapter of that name has: a prefill worker whose adapter differs refuses it
    adapter: str = field(default="", metadata=_spec(ADAPTER_NAME))
    adapter_fingerprint: str = field(default="", metadata=_spec(FINGERPRINT))

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
    cached: CachedTokens = field(default_factory=CachedTokens, metadata=_spec(CACHED))
    first_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    prompt_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    spans: tuple[SpanRecord, ...] = field(default=(), metadata=_spec(SPAN_RECORDS))  # traced
    lease_ms: float | None = field(default=None, metadata=_spec(OptionalSpec(DURATION_MS)))
    # the fingerprint of the LoRA adapter the pages were computed with ("" = the base
    # model): the reader reads them only if it equals its own request's
    adapter_fingerprint: str = field(default="", metadata=_spec(FINGERPRINT))


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
    cached: CachedTokens = field(default_factory=CachedTokens, metadata=_spec(CACHED))
    completion_tokens: int = field(default=0, metadata=_spec(COUNT))
    ttft_ms: float | None = field(default=None, metadata=_spec(OptionalSpec(DURATION_MS)))
    index: int = field(default=0, metadata=_spec(IntSpec(0, 2**31 - 1)))
    logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
    prompt_logprobs: tuple[LogprobEntry, ...] = field(default=(), metadata=_spec(LOGPROB_ENTRIES))
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
