"""Message types: registry, round trips of every type, normalisation, SamplingSpec."""

from __future__ import annotations

from types import MappingProxyType

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from radixserve.engine.fair_share import TenantShare
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.wire import share_fields, to_chunk, to_output, to_params, to_share, to_spec
from radixserve.errors import InvalidRequestError
from radixserve.protocol import codec
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.fields import FinishReason
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
from radixserve.protocol.lora_messages import LoraAdapterInfo, LoraLoad, LoraReply, LoraUnload
from radixserve.protocol.messages import (
    ALL_MESSAGES,
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
from radixserve.protocol.peer_messages import PeerPages, PeerRead
from radixserve.protocol.sampling import SamplingSpec
from radixserve.protocol.stats_messages import (
    EngineSection,
    HistogramStats,
    KVStoreSection,
    PrefillSection,
    ServiceStats,
)
from radixserve.protocol.view_messages import (
    CacheAuditClear,
    CacheAuditCleared,
    CacheNodeView,
    CacheTreeQuery,
    CacheTreeReply,
    LiveRequestView,
)
from radixserve.protocol.wire import Message

# Strategies state what a valid message is, independently of the specs in messages.py.
ids = st.text(min_size=1, max_size=40)
names = st.text(min_size=1, max_size=30)
text = st.text(max_size=60)
token_id = st.integers(0, 2**31 - 1)
token_ids = st.lists(token_id, max_size=40).map(tuple)
prompt = st.lists(token_id, min_size=1, max_size=40).map(tuple)
page_ids = st.lists(st.integers(0, 2**31 - 1), max_size=20).map(tuple)
page_hashes = st.lists(st.integers(0, 2**128 - 1), max_size=20).map(tuple)
count = st.integers(0, 2**63 - 1)
cached_tokens = st.builds(CachedTokens, device=count, peer=count, host=count, disk=count)
millis = st.floats(0.0, 1e9, allow_nan=False)
roles = st.sampled_from(["gateway", "prefill", "decode", "kvstore"])

sampling = st.builds(
    SamplingSpec,
    max_tokens=st.integers(1, 2**31 - 1),
    min_tokens=st.integers(0, 2**31 - 1),
    temperature=st.floats(0.0, 100.0),
    top_p=st.floats(0.0, 1.0),
    top_k=st.integers(-1, 2**31 - 1),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.lists(st.text(max_size=20), max_size=5).map(tuple),
    stop_token_ids=token_ids,
    ignore_eos=st.booleans(),
)


@st.composite
def prefill_requests(draw: st.DrawFn) -> PrefillRequest:
    tokens = draw(prompt)
    return PrefillRequest(
        request_id=draw(ids),
        token_ids=tokens,
        dst_page_ids=draw(page_ids),
        sampling=draw(sampling),
        num_cached_tokens=draw(st.integers(0, len(tokens) - 1)),
    )


@st.composite
def token_chunks(draw: st.DrawFn) -> TokenChunk:
    finished = draw(st.booleans())
    reasons: list[FinishReason] = ["stop", "length", "abort"]
    reason = draw(st.sampled_from(reasons)) if finished else None
    return TokenChunk(
        request_id=draw(ids),
        token_ids=draw(token_ids),
        text=draw(text),
        finished=finished,
        finish_reason=reason,
        prompt_tokens=draw(count),
        cached=draw(cached_tokens),
        completion_tokens=draw(count),
        ttft_ms=draw(st.none() | millis),
        route=draw(st.sampled_from(["", "local", "host", "remote"])),
        prefill_worker=draw(st.text(max_size=30)),
    )


@st.composite
def spill_offers(draw: st.DrawFn) -> SpillOffer:
    hashes = draw(page_hashes)
    pages = draw(st.lists(st.integers(0, 2**31 - 1), min_size=len(hashes), max_size=len(hashes)))
    size = draw(st.integers(1, 4))
    tokens = draw(st.lists(st.integers(0, 2**31 - 1), min_size=size * len(hashes),
                           max_size=size * len(hashes)))  # fmt: skip
    runs, left = [], len(hashes)
    while left:
        n = draw(st.integers(1, left))
        parent = draw(st.lists(st.integers(0, 2**128 - 1), max_size=1).map(tuple))
        runs.append(SpillRun(n, draw(st.binary(min_size=32, max_size=32)), parent))
        left -= n
    return SpillOffer(spill_id=draw(st.integers(1, 2**63 - 1)), page_hashes=hashes,
                      buffer_page_ids=tuple(pages), token_ids=tuple(tokens),
                      runs=tuple(runs))  # fmt: skip


load_stats = st.dictionaries(
    st.text(min_size=1, max_size=20),
    st.integers(-(2**63) + 1, 2**63 - 1) | st.floats(-1e12, 1e12, allow_nan=False),
    max_size=8,
)

histograms = st.integers(0, 8).flatmap(
    lambda n: st.builds(
        HistogramStats,
        bounds=st.lists(st.floats(0, 1e6), min_size=n, max_size=n).map(lambda b: tuple(sorted(b))),
        counts=st.lists(count, min_size=n + 1, max_size=n + 1).map(lambda c: tuple(sorted(c))),
        sum=st.floats(0, 1e9),
    )
)
service_stats = st.builds(
    ServiceStats,
    tasks=count,
    uptime_s=st.floats(0, 1e9),
    heartbeats_total=count,
    engine=st.none()
    | st.builds(
        EngineSection,
        pages_total=count,
        pages_cached=st.none() | count,
        engine_busy_seconds_total=st.floats(0, 1e9),
    ),  # fmt: skip
    prefill=st.none()
    | st.builds(
        PrefillSection, prefill_requests_total=count, prefill_wait_seconds=histograms
    ),  # fmt: skip
    kvstore=st.none() | st.builds(KVStoreSection, members=count),
)

members = st.builds(
    MemberInfo,
    name=names,
    role=roles,
    address=st.text(min_size=1, max_size=40),
    generation=count,
    draining=st.booleans(),
)

request_ids = st.lists(ids, max_size=16).map(tuple)
cache_nodes = st.builds(
    CacheNodeView,
    node_id=count,
    parent_id=count,
    num_tokens=count,
    prefix_tokens=count,
    num_pages=count,
    subtree_pages=count,
    hits=count,
    locks=count,
    last_hit_s=st.floats(0.0, 1e10, allow_nan=False),
    text=text,
    recent_request_ids=request_ids,
    live_request_ids=request_ids,
)
live_requests = st.builds(
    LiveRequestView,
    request_id=ids,
    phase=st.sampled_from(["queued", "host_load", "awaiting_kv", "prefill", "decode", "leased"]),
    prompt_tokens=count,
    computed_tokens=count,
    cached=cached_tokens,
    output_tokens=count,
)
fingerprints = st.just("") | st.text("0123456789abcdef", min_size=64, max_size=64).map(
    lambda h: "sha256:" + h
)
lora_ids = st.text(min_size=1, max_size=32)
lora_names = st.text(min_size=1, max_size=32)
lora_infos = st.builds(LoraAdapterInfo, name=lora_names, fingerprint=fingerprints,
                       hash_namespace=st.binary(max_size=32), path=st.text(max_size=40))  # fmt: skip

STRATEGIES: dict[type[Message], st.SearchStrategy[Message]] = {
    Hello: st.builds(Hello, name=names, role=roles, generation=count),
    HelloAck: st.builds(
        HelloAck,
        name=names,
        role=roles,
        generation=count,
        accepted=st.booleans(),
        reason=text,
        model_name=text.map(lambda t: t[:256]),
        max_model_len=count,
        page_size=count,
        hash_namespace=st.binary(max_size=64),
        pool_digest=st.text(alphabet="0123456789abcdef", max_size=64),
        transfer_metadata=st.binary(max_size=64),
    ),
    Heartbeat: st.builds(
        Heartbeat,
        sender=names,
        generation=count,
        load=st.builds(
            WorkerLoad, queued_tokens=count, running=count, waiting=count, draining=st.booleans()
        ),
        stats=service_stats,
    ),
    GenerateRequest: st.builds(
        GenerateRequest,
        request_id=ids,
        prompt_token_ids=prompt,
        sampling=sampling,
        page_hashes=st.lists(st.integers(0, 2**128 - 1), max_size=20).map(tuple),
        resume_token_ids=st.lists(token_id, max_size=8).map(tuple),
        adapter=st.text(max_size=20),
        adapter_fingerprint=fingerprints,
    ),
    PrefillRequest: prefill_requests(),
    KVReady: st.builds(
        KVReady,
        request_id=ids,
        first_token_ids=prompt,
        src_page_ids=page_ids,
        cached=cached_tokens,
        adapter_fingerprint=fingerprints,
    ),
    TransferDone: st.builds(TransferDone, request_id=ids, ok=st.booleans()),
    PeerRead: st.builds(
        PeerRead,
        read_id=ids,
        token_ids=prompt,
        first_page=count,
        num_pages=count,
        cache_scope=text,
        adapter=lora_names | st.just(""),
        adapter_fingerprint=fingerprints,
    ),  # fmt: skip
    PeerPages: st.builds(PeerPages, read_id=ids, src_page_ids=page_ids, lease_ms=millis),
    TokenChunk: token_chunks(),
    Abort: st.builds(Abort, request_id=ids),
    RequestFailed: st.builds(
        RequestFailed,
        request_id=ids,
        error_type=st.sampled_from(
            ["invalid_request", "capacity", "internal", "timeout", "peer_lost", "draining"]
        ),
        message=text,
    ),
    KVEvent: st.builds(
        KVEvent,
        worker=names,
        generation=count,
        seq=st.integers(1, 2**63 - 1),
        kind=st.sampled_from(["stored", "removed", "cleared"]),
        page_hashes=page_hashes,
    ),
    KVResync: st.builds(KVResync, reason=text),
    IndexQuery: st.builds(IndexQuery, query_id=ids, page_hashes=page_hashes),
    IndexReply: st.builds(IndexReply, query_id=ids, device_pages=load_stats, host_pages=count),
    HostAttach: st.builds(
        HostAttach, worker=names, generation=count, metadata=st.binary(max_size=64)
    ),
    HostAttachAck: st.builds(
        HostAttachAck,
        accepted=st.booleans(),
        metadata=st.binary(max_size=64),
        num_pages=count,
        reason=text,
        disk_tier=st.booleans(),
    ),
    SpillOffer: spill_offers(),
    SpillDone: st.builds(SpillDone, spill_id=st.integers(1, 2**63 - 1), stored=count),
    HostLookup: st.builds(
        HostLookup,
        query_id=ids,
        page_hashes=page_hashes,
        prefill_tokens_per_s=st.floats(0, 1e9, allow_nan=False),
        reads_loading=st.booleans(),
    ),
    HostLease: st.builds(
        HostLease,
        query_id=ids,
        lease_id=count,
        host_page_ids=page_ids,
        disk_pages=count,
        loading=st.booleans(),
        ready_pages=count,
    ),
    HostPagesReady: st.builds(
        HostPagesReady, query_id=ids, ready_pages=count, failed=st.booleans()
    ),
    HostRelease: st.builds(HostRelease, lease_id=st.integers(1, 2**63 - 1)),
    Register: st.builds(Register, member=members),
    Deregister: st.builds(Deregister, name=names, generation=count),
    WatchMembers: st.builds(WatchMembers, roles=st.lists(roles, max_size=4).map(tuple)),
    MemberList: st.builds(
        MemberList, epoch=count, version=count, members=st.lists(members, max_size=5).map(tuple)
    ),
    CacheTreeQuery: st.builds(
        CacheTreeQuery, query_id=ids, max_nodes=st.integers(0, 1024), text_tokens=st.integers(0, 64)
    ),
    CacheTreeReply: st.builds(
        CacheTreeReply,
        query_id=ids,
        nodes=st.lists(cache_nodes, max_size=4).map(tuple),
        num_nodes=count,
        cached_pages=count,
        requests=st.lists(live_requests, max_size=4).map(tuple),
        num_live=count,
    ),
    CacheAuditClear: st.builds(CacheAuditClear, query_id=ids),
    LoraLoad: st.builds(
        LoraLoad, query_id=lora_ids, name=lora_names, path=st.text(min_size=1, max_size=60)
    ),  # fmt: skip
    LoraUnload: st.builds(LoraUnload, query_id=lora_ids, name=lora_names),
    LoraReply: st.builds(
        LoraReply,
        query_id=lora_ids,
        error_type=st.sampled_from(["", "invalid_request", "not_found"]),
        message=text,
        adapter=st.none() | lora_infos,
    ),  # fmt: skip
    CacheAuditCleared: st.builds(CacheAuditCleared, query_id=ids, was_failed=st.booleans()),
}

any_message = st.one_of(*STRATEGIES.values())


def test_registry_holds_every_message_once_under_a_stable_tag() -> None:
    assert set(STRATEGIES) == set(ALL_MESSAGES) == set(MESSAGE_TYPES.values())
    assert MESSAGE_TYPES["prefill_request"] is PrefillRequest
    assert MESSAGE_TYPES["kv_ready"] is KVReady
    assert all(tag != cls.__name__ for tag, cls in MESSAGE_TYPES.items())
    assert all(tag == tag.lower() for tag in MESSAGE_TYPES)


@settings(max_examples=300, deadline=None)
@given(any_message)
def test_every_message_round_trips(msg: Message) -> None:
    frame = codec.encode(msg)
    decoded = codec.decode(frame)
    assert type(decoded) is type(msg)
    assert decoded == msg


@settings(max_examples=50, deadline=None)
@given(any_message)
def test_frame_is_a_string_keyed_map_with_tag_and_version(msg: Message) -> None:
    body = msgpack.unpackb(codec.encode(msg), raw=False)
    assert body["type"] == type(msg).TYPE_TAG
    assert body["v"] == list(PROTOCOL_VERSION)
    assert all(isinstance(key, str) for key in body)


def test_lists_become_tuples_and_maps_become_read_only() -> None:
    stop: list[str] = ["x"]
    spec = SamplingSpec(stop=stop, temperature=1)  # type: ignore[arg-type]
    msg = GenerateRequest("r", [1, 2], sampling=spec)  # type: ignore[arg-type]
    assert msg.prompt_token_ids == (1, 2)
    assert msg.sampling.stop == ("x",)
    assert isinstance(msg.sampling.temperature, float)
    reply = IndexReply("q", device_pages={"running": 3})
    assert isinstance(reply.device_pages, MappingProxyType)
    assert reply.device_pages == {"running": 3}
    assert codec.decode(codec.encode(reply)) == reply
    beat = Heartbeat("w", stats=ServiceStats(uptime_s=2, engine=EngineSection(pages_total=4)))
    assert isinstance(beat.stats.uptime_s, float)  # an int given for a float is one
    assert codec.decode(codec.encode(beat)) == beat
    listing = MemberList(1, 2, [MemberInfo("d", "decode", "tcp://h:1")])  # type: ignore[arg-type]
    assert listing.members == (MemberInfo("d", "decode", "tcp://h:1"),)
    assert codec.decode(codec.encode(listing)) == listing


def test_defaults_fill_optional_fields() -> None:
    chunk = TokenChunk("r")
    assert (chunk.token_ids, chunk.text, chunk.finished, chunk.finish_reason) == (
        (),
        "",
        False,
        None,
    )
    assert Hello("a", "decode").generation == 0
    assert GenerateRequest("r", (1,)).sampling == SamplingSpec()


sampling_params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 10_000),
    min_tokens=st.just(0),
    temperature=st.floats(0.0, 100.0),
    top_p=st.floats(0.0, 1.0, exclude_min=True),
    top_k=st.integers(-1, 1000),
    seed=st.none() | st.integers(-(2**63), 2**64 - 1),
    stop=st.lists(st.text(min_size=1, max_size=10), max_size=4).map(tuple),
    stop_token_ids=st.lists(token_id, max_size=8).map(tuple),
    ignore_eos=st.booleans(),
)


@settings(max_examples=100, deadline=None)
@given(sampling_params)
def test_sampling_spec_round_trips_sampling_params_over_the_wire(params: SamplingParams) -> None:
    request = GenerateRequest("r", (1,), sampling=to_spec(params))
    decoded = codec.decode(codec.encode(request))
    assert isinstance(decoded, GenerateRequest)
    assert to_params(decoded.sampling) == params


def test_sampling_spec_to_params_applies_semantic_checks() -> None:
    spec = SamplingSpec(max_tokens=4, min_tokens=5)
    assert codec.decode(codec.encode(GenerateRequest("r", (1,), sampling=spec)))
    with pytest.raises(InvalidRequestError, match="min_tokens"):
        to_params(spec)


def test_token_chunk_carries_a_request_output_both_ways() -> None:
    from radixserve.engine.outputs import RequestOutput
    from radixserve.protocol.codec import decode, encode

    out = RequestOutput("r", [5, 6], "hi", True, "length", 12, 3, 41.5, CachedTokens(4, 1, 2, 2))
    chunk = to_chunk(out)
    assert decode(encode(chunk)) == chunk
    assert to_output(chunk) == out
    running = RequestOutput("r", [5], "h", False, None, 12, 1, 41.5)
    assert to_output(to_chunk(running)) == running


def test_a_requests_tenant_share_crosses_the_wire_and_old_frames_get_the_default() -> None:
    share = TenantShare("0123456789abcdef", -7, 2.5)
    for msg in (GenerateRequest("r", (1,), **share_fields(share)),
                PrefillRequest("r", (1, 2), (0,), **share_fields(share))):  # fmt: skip
        decoded = codec.decode(codec.encode(msg))
        assert decoded == msg and to_share(decoded) == share  # type: ignore[arg-type]
    # a 5.0 peer's frame has no such keys: one tenant, priority 0, weight 1
    body = msgpack.unpackb(codec.encode(GenerateRequest("r", (1,))), raw=False)
    for key in ("tenant", "priority", "tenant_weight"):
        del body[key]
    old = codec.decode(msgpack.packb(body))
    assert to_share(old) == TenantShare()  # type: ignore[arg-type]
    for key, value in (("priority", 101), ("tenant_weight", 0.0), ("tenant", "x" * 65)):
        bad = msgpack.packb({**body, key: value})
        with pytest.raises(codec.ProtocolError, match=key):
            codec.decode(bad)
