"""What a service's heartbeat says of it besides its load: `ServiceStats`, typed.

Every service fills the common fields; the sections say what it runs: a worker's
``engine`` (its pool, steps and cache audit), its ``host_tier`` client, a decode
worker's ``decode``, a prefill worker's ``prefill``, the kvstore's ``kvstore`` (with its
``host`` and ``disk`` tiers). A section, or a field, that is None is not there (a
tier not configured, a cache audit that is off): it is neither exported nor shown.

Each number's field carries its Prometheus meaning (`MetricSpec`): the gateway exports
it, and each service its own, as ``radixserve_worker_<field>`` (a counter's ``_total``
is the exposition's), by the one table built from these structs,
`radixserve.worker_metrics.WORKER_METRICS`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from radixserve.protocol.fields import COUNT
from radixserve.protocol.lora_messages import LORA_INFOS, LoraAdapterInfo
from radixserve.protocol.wire import FloatSpec, ListSpec, NestedSpec, OptionalSpec, WireStruct

MetricKind = Literal["gauge", "counter", "histogram"]
MAX_BUCKETS = 64
REAL = FloatSpec()  # seconds, rates: finite and >= 0


@dataclass(frozen=True)
class MetricSpec:
    """How a field is exported: its kind and help; ``name`` when not
    ``radixserve_worker_<field>``; not ``exported`` on its own (read into another
    family, such as the cache audit's ``result``s)."""

    kind: MetricKind
    help: str
    name: str = ""
    exported: bool = True


def _number(kind: MetricKind, help: str, real: bool, optional: bool, **spec: Any) -> Any:
    wire = REAL if real else COUNT
    meta = {
        "wire": OptionalSpec(wire) if optional else wire,
        "metric": MetricSpec(kind, help, **spec),
    }
    return dataclasses.field(default=None if optional else 0.0 if real else 0, metadata=meta)


def gauge(help: str, *, real: bool = False, optional: bool = False, **spec: Any) -> Any:
    """A gauge field (an int; a float with ``real``; None = absent with ``optional``)."""
    return _number("gauge", help, real, optional, **spec)


def counter(help: str, *, real: bool = False, optional: bool = False, **spec: Any) -> Any:
    """A counter field (named ``*_total``)."""
    return _number("counter", help, real, optional, **spec)


def section(cls: type[WireStruct]) -> Any:
    """An optional nested section of the stats."""
    return dataclasses.field(default=None, metadata={"wire": OptionalSpec(NestedSpec(cls))})


@dataclass(frozen=True)
class HistogramStats(WireStruct):
    """A histogram: cumulative counts at each upper bound of ``bounds`` and, last, of
    every observation (``+Inf``); the sum of the observations."""

    bounds: tuple[float, ...] = dataclasses.field(
        default=(), metadata={"wire": ListSpec(REAL, MAX_BUCKETS)}
    )
    counts: tuple[int, ...] = dataclasses.field(
        default=(0,), metadata={"wire": ListSpec(COUNT, MAX_BUCKETS + 1, 1)}
    )
    sum: float = dataclasses.field(default=0.0, metadata={"wire": REAL})

    def invariant_error(self) -> str | None:
        if len(self.counts) != len(self.bounds) + 1:
            return "a histogram needs one count per bound and one for +Inf"
        return None


def histogram(help: str) -> Any:
    meta = {"wire": NestedSpec(HistogramStats), "metric": MetricSpec("histogram", help)}
    return dataclasses.field(default_factory=HistogramStats, metadata=meta)


def mismatches() -> Any:
    """``kv_identity_mismatch_total``: exported as ``radixserve_kv_identity_mismatch``."""
    return counter(
        "KV pages of the host or disk tier refused because their stored tokens do not "
        "prove their hash or do not match the prompt's (dropped, recomputed).",
        name="radixserve_kv_identity_mismatch",
    )


@dataclass(frozen=True)
class EngineSection(WireStruct):
    """A worker's engine: its pool's pages (`KVCacheManager.stats`), live requests, cache
    audit (None: off), step counters (`radixserve.engine.step_stats`), its cache's use
    and its LoRA adapter slots (`radixserve.model.lora_manager`)."""

    pages_total: int = gauge("Pages of the KV pool.")
    pages_used: int = gauge("Pages held by requests or the cache.")
    pages_free: int = gauge("Free pages (those reserved for running requests included).")
    pages_reserved: int = gauge("Free pages reserved for running requests' next tokens.")
    leases: int = gauge("Page leases held for readers.")
    host_loads_in_flight: int = gauge("Loads from the host tier in flight.")
    page_refs_outside_cache: int = gauge("Page references held outside the cache (0 at rest).")
    pages_cached: int | None = gauge("Pages the prefix cache holds.", optional=True)
    pages_locked: int | None = gauge("Cached pages locked by requests.", optional=True)
    pages_evictable: int | None = gauge("Cached pages that may be evicted.", optional=True)
    cache_locks: int | None = gauge("Locks held on cache nodes.", optional=True)
    radix_matches_total: int | None = counter("Prefix lookups in the cache.", optional=True)
    live_requests: int = gauge("Requests the engine holds.")
    audit_checked: int | None = counter("Cache hits audited.", optional=True, exported=False)
    audit_mismatches: int | None = counter("Audits that did not match.", optional=True,
                                           exported=False)  # fmt: skip
    audit_skipped: int | None = counter("Audits skipped.", optional=True, exported=False)
    audit_pending: int | None = gauge("Audits waiting to run.", optional=True)
    audit_fail_closed: int | None = gauge(
        "1 while a failed-closed cache audit keeps the engine off its cache.", optional=True
    )
    engine_steps_total: int = counter("Engine steps.")
    engine_busy_seconds_total: float = counter("Seconds spent in steps.", real=True)
    engine_prefill_tokens_total: int = counter("Prompt tokens run through the model.")
    engine_prefill_seconds_total: float = counter("Prefill share of step time.", real=True)
    engine_decode_tokens_total: int = counter("Decoded tokens (one per sequence per step).")
    engine_decode_seconds_total: float = counter("Decode share of step time.", real=True)
    engine_decode_only_steps_total: int = counter("Steps that only decoded.")
    engine_decode_only_seqs_total: int = counter("Sequences of the decode-only steps.")
    engine_decode_only_seconds_total: float = counter("Seconds of decode-only steps.", real=True)
    speculative_prompt_steps_total: int = counter(
        "Verification chunks of drafts from the request's own tokens."
    )
    speculative_prompt_drafted_total: int = counter(
        "Draft tokens from the request's own tokens verified."
    )
    speculative_prompt_accepted_total: int = counter(
        "Draft tokens from the request's own tokens kept."
    )
    speculative_prompt_emitted_total: int = counter(
        "Tokens appended by verification chunks of drafts from the request's own tokens."
    )
    speculative_radix_steps_total: int = counter(
        "Verification chunks of drafts from the draft index (cached text)."
    )
    speculative_radix_drafted_total: int = counter(
        "Draft tokens from the draft index (cached text) verified."
    )
    speculative_radix_accepted_total: int = counter(
        "Draft tokens from the draft index (cached text) kept."
    )
    speculative_radix_emitted_total: int = counter(
        "Tokens appended by verification chunks of drafts from the draft index (cached text)."
    )
    queued_prompt_tokens: int = gauge("Prompt tokens of unfinished prefills.")
    cpu_threads: int = gauge("Torch threads in the last step (0: not set).")
    page_bytes: int | None = gauge("Bytes of one page.", optional=True)
    kv_transfer_refused_reads_total: int | None = counter(
        "Peers' reads of pages not lent to them.", optional=True
    )
    kv_events_dropped_total: int = counter("Cache events not sent to the kvstore.")
    prompt_hashes_total: int = counter("Prompts whose pages the worker hashed.")
    prefix_cache_queried_tokens_total: int = counter("Prompt tokens looked up at admission.")
    prefix_cache_hit_tokens_total: int = counter("Prompt tokens found in the device cache.")
    lora_resident: int = gauge("LoRA adapters in a device slot.")
    lora_max: int = gauge("LoRA adapter slots on the device (max_loras).")
    lora_loads_total: int = counter("Copies of a LoRA adapter into a device slot.")
    lora_evictions_total: int = counter("LoRA adapters evicted from their slot for another.")
    lora_waiting_requests: int = gauge(
        "Waiting requests whose LoRA adapter finds no free slot (every slot another running "
        "adapter's)."
    )


@dataclass(frozen=True)
class HostTierSection(WireStruct):
    """A worker's client of the kvstore's host tier (`radixserve.runtime.host_tier`)."""

    host_spills_total: int = counter("Spills of pages to the host tier.")
    host_spill_pages_total: int = counter("Pages spilled to the host tier.")
    host_spill_bytes_total: int = counter("Bytes spilled to the host tier.")
    host_spill_stored_pages_total: int = counter("Spilled pages the host tier stored.")
    host_spill_dropped_pages_total: int = counter("Pages not spilled: no buffer was free.")
    host_loads_total: int = counter("Loads from the host tier.")
    host_load_pages_total: int = counter("Pages loaded from the host tier.")
    host_load_bytes_total: int = counter("Bytes loaded from the host tier.")
    host_load_failures_total: int = counter("Loads from the host tier that failed.")
    host_lookups_total: int = counter("Lookups in the host tier.")
    host_lookup_timeouts_total: int = counter("Host-tier lookups not answered in time.")
    host_disk_leases_total: int = counter("Host-tier leases with pages still on disk.")
    host_remote_loads_total: int = counter("Loads from another node's host tier.")
    host_remote_load_pages_total: int = counter("Pages loaded from another node's host tier.")
    kv_identity_mismatch_total: int = mismatches()
    host_spill_buffer_free: int = gauge("Free pages of the spill buffer.")
    host_spill_refused_reads_total: int = counter("Reads of spill pages not offered.")
    host_spill_buffer_pages: int = gauge("Pages of the spill buffer.")
    host_load_seconds_total: float = counter("Seconds spent loading host pages.", real=True)
    host_attached: int = gauge("1 while attached to the kvstore's host tier.")
    host_attach_settled: int = gauge("0 until the kvstore answered the attach.")


@dataclass(frozen=True)
class PeerReadSection(WireStruct):
    """A worker's reads of other workers' cached pages, and its lending of its own
    (`radixserve.runtime.peer_reads`)."""

    peer_read_asks_total: int = counter("Peers asked to lend a prompt's cached pages.")
    peer_read_refusals_total: int = counter("Peer reads not lent (refused, none, no answer).")
    peer_reads_skipped_total: int = counter("Peer reads not asked: computing was quicker.")
    peer_reads_total: int = counter("Reads of pages from peers' caches.")
    peer_read_pages_total: int = counter("Pages read from peers' caches.")
    peer_read_bytes_total: int = counter("Bytes read from peers' caches.")
    peer_read_failures_total: int = counter("Peer reads that failed (the prompt computed).")
    peer_read_seconds_total: float = counter("Seconds spent reading peers' pages.", real=True)
    peer_connects_total: int = counter(
        "Connections to other workers' pages, made as links came up."
    )
    peer_read_connects_total: int = counter("Peer reads that first had to connect to the owner.")
    peer_lends_total: int = counter("Reads of this worker's pages it lent to peers.")
    peer_lent_pages_total: int = counter("Pages this worker lent to peers.")


@dataclass(frozen=True)
class DecodeSection(WireStruct):
    """A decode worker's: prefill workers, KV transfers and where prompts were computed."""

    prefills_up: int = gauge("Prefill workers up.")
    awaiting_kv: int = gauge("Requests waiting for a prefill worker's pages.")
    kv_transfers_total: int = counter("KV transfers into the worker.")
    kv_transfer_pages_total: int = counter("Pages transferred into the worker.")
    kv_transfer_bytes_total: int = counter("Bytes transferred into the worker.")
    kv_transfer_seconds_total: float = counter("Seconds of KV transfers.", real=True)
    local_prefills_total: int = counter("Prompts computed by the decode worker itself.")
    remote_prefills_total: int = counter("Prompts computed by a prefill worker.")
    remote_prefill_failures_total: int = counter("Remote prefills that failed.")
    resumed_requests_total: int = counter("Streams moved here from another worker.")
    token_endpoint_messages_total: int = counter(
        "Messages to gateways sent on the token endpoint (the rest go on the control socket)."
    )
    token_fallbacks_total: int = counter(
        "Requests whose messages went on the control socket: the gateway's token link was not "
        "connected."
    )
    index_queries_total: int = counter("Questions to the kvstore's index.")
    index_misses_total: int = counter("Index questions not answered in time.")
    index_partial_answers_total: int = counter(
        "Index questions some shards of the index did not answer in time (a kvstore down)."
    )


@dataclass(frozen=True)
class PrefillSection(WireStruct):
    """A prefill worker's requests and, per request, its size and its wait."""

    prefill_requests_total: int = counter("Prefill requests served.")
    prefill_computed_tokens_total: int = counter("Prompt tokens computed.")
    prefill_cached_tokens_total: int = counter("Prompt tokens found cached.")
    prefill_wait_seconds: HistogramStats = histogram(
        "A request's time to its first token less its own compute."
    )
    prefill_request_tokens: HistogramStats = histogram("A request's uncached prompt tokens.")


@dataclass(frozen=True)
class HostPoolSection(WireStruct):
    """The kvstore's host-memory tier; its pages None until a worker attached (the
    pages it refused count in `KVStoreSection`'s ``kv_identity_mismatch_total``)."""

    host_spill_offers_total: int = counter("Spill offers received.")
    host_spill_failures_total: int = counter("Spills that failed.")
    host_spill_refused_pages_total: int = counter("Spilled pages refused (unproved).")
    host_lookups_total: int = counter("Lookups answered.")
    host_bytes_stored_total: int = counter("Bytes stored.")
    host_pages_total: int | None = gauge("Pages of the host tier.", optional=True)
    host_pages_used: int | None = gauge("Host pages stored or being written.", optional=True)
    host_pages_free: int | None = gauge("Free host pages.", optional=True)
    host_pages_stored: int | None = gauge("Host pages stored.", optional=True)
    host_pages_leased: int | None = gauge("Host pages lent to readers.", optional=True)
    host_leases: int | None = gauge("Host-tier leases held.", optional=True)
    host_evictions_total: int | None = counter("Host pages evicted.", optional=True)
    host_stored_pages_total: int | None = counter("Pages stored in the host tier.", optional=True)
    host_hit_pages_total: int | None = counter("Host pages lent on a hit.", optional=True)


@dataclass(frozen=True)
class DiskPoolSection(WireStruct):
    """The kvstore's disk tier (`services.kvstore.disk_pool`)."""

    disk_pages_total: int = gauge("Page records of the disk tier.")
    disk_pages_used: int = gauge("Disk records stored or being written.")
    disk_pages_free: int = gauge("Free disk records.")
    disk_pages_stored: int = gauge("Disk records stored.")
    disk_pages_leased: int = gauge("Disk records being read.")
    disk_leases: int = gauge("Disk-tier leases held.")
    disk_evictions_total: int = counter("Disk records evicted.")
    disk_stored_pages_total: int = counter("Pages stored on disk.")
    disk_hit_pages_total: int = counter("Disk pages promoted on a hit.")
    disk_writes_total: int = counter("Write rounds.")
    disk_write_pages_total: int = counter("Pages written.")
    disk_write_bytes_total: int = counter("Bytes written.")
    disk_write_dropped_pages_total: int = counter("Pages not written (no room).")
    disk_promotions_total: int = counter("Promotions into the host tier.")
    disk_overlapped_promotions_total: int = counter("Promotions overlapped with a read.")
    disk_read_pages_total: int = counter("Pages read.")
    disk_read_bytes_total: int = counter("Bytes read.")
    disk_recomputed_pages_total: int = counter("Pages on disk recomputed instead.")
    disk_corrupt_pages_total: int = counter("Corrupt records dropped.")
    disk_foreign_pages: int = gauge("Records of another pool found at start.")
    disk_restored_pages: int = gauge("Records adopted at start.")
    disk_tier_up: int = gauge("1 while the disk tier works.")
    disk_tier_full: int = gauge("1 once no file could be added.")
    disk_bytes_total: int = gauge("Bytes of the tier's files.")
    disk_bytes_bound: int = gauge("Bytes the tier may use.")
    disk_bytes_stored: int = gauge("Bytes of the records stored.")
    disk_direct_io: int = gauge("1 when the files use direct I/O.")
    disk_write_queued_pages: int = gauge("Pages staged to be written.")
    disk_read_bytes_per_s: int = gauge("Read rate (moving average).")
    disk_read_seconds_total: float = counter("Seconds spent reading.", real=True)
    disk_write_bytes_per_s: int = gauge("Write rate (moving average).")
    disk_write_seconds_total: float = counter("Seconds spent writing.", real=True)
    disk_tier_ready: int = gauge("0 while the tier adopts its files.")


@dataclass(frozen=True)
class KVStoreSection(WireStruct):
    """The kvstore: its members, its index of the workers' pages, and its tiers."""

    members: int = gauge("Members registered.")
    member_watchers: int = gauge("Peers watching the membership.")
    members_gateway: int = gauge("Gateways registered.")
    members_prefill: int = gauge("Prefill workers registered.")
    members_decode: int = gauge("Decode workers registered.")
    members_kvstore: int = gauge("Kvstores registered.")
    index_pages: int = gauge("Pages in the index.")
    index_workers: int = gauge("Workers in the index.")
    index_events_total: int = counter("Cache events applied to the index.")
    index_resyncs_total: int = counter("Workers' resyncs of the index.")
    index_max_event_age_s: float = gauge("Seconds since a worker's last event, at most.",
                                         real=True)  # fmt: skip
    kv_identity_mismatch_total: int = mismatches()
    host: HostPoolSection | None = section(HostPoolSection)
    disk: DiskPoolSection | None = section(DiskPoolSection)


@dataclass(frozen=True)
class ServiceStats(WireStruct):
    """A service's numbers in its `Heartbeat`: its own, then a section per part it runs."""

    tasks: int = gauge("Requests the service is running.")
    uptime_s: float = gauge("Seconds since the service started.", real=True)
    heartbeats_total: int = counter("Heartbeat rounds.")
    refused_draining_total: int = counter("Requests refused while draining.")
    auth_refused_total: int = counter("Peers whose handshake failed.")
    engine: EngineSection | None = section(EngineSection)
    host_tier: HostTierSection | None = section(HostTierSection)
    peer_reads: PeerReadSection | None = section(PeerReadSection)
    decode: DecodeSection | None = section(DecodeSection)
    prefill: PrefillSection | None = section(PrefillSection)
    kvstore: KVStoreSection | None = section(KVStoreSection)
    # a worker's loaded LoRA adapters (`radixserve.protocol.lora_messages`), by name
    loras: tuple[LoraAdapterInfo, ...] = dataclasses.field(
        default=(), metadata={"wire": LORA_INFOS}
    )


_S = TypeVar("_S", bound=WireStruct)


def fill(cls: type[_S], counters: Mapping[str, Any], **values: Any) -> _S:
    """A ``cls`` section from the counters (a mapping) named like its fields, and ``values``."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in counters.items() if k in names}, **values)
