"""Codec validation: every malformed frame becomes a ProtocolError saying what and where."""

from __future__ import annotations

import contextlib
import dataclasses
import tracemalloc
from dataclasses import dataclass
from typing import Any, ClassVar

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from radixserve.errors import RadixServeError
from radixserve.protocol.codec import (
    DEFAULT_MAX_FRAME_BYTES,
    FRAME_LIMITS,
    ProtocolError,
    decode,
    encode,
)
from radixserve.protocol.fields import MAX_PAGES_PER_MESSAGE
from radixserve.protocol.host_messages import HostLookup, SpillOffer, SpillRun
from radixserve.protocol.index_messages import IndexReply, MemberList
from radixserve.protocol.link_messages import Heartbeat, Hello, HelloAck
from radixserve.protocol.messages import (
    PROTOCOL_VERSION,
    GenerateRequest,
    KVReady,
    PrefillRequest,
    TokenChunk,
)
from radixserve.protocol.sampling import SamplingSpec
from radixserve.protocol.wire import HASH_BYTES, MAX_TEXT_CHARS, MAX_TOKENS_PER_MESSAGE, Message

PREFILL = PrefillRequest(
    request_id="req-1",
    token_ids=(1, 2, 3, 4, 5),
    dst_page_ids=(7, 8),
    sampling=SamplingSpec(max_tokens=8, seed=3),
    num_cached_tokens=2,
)


def body_of(msg: Message) -> dict[str, Any]:
    """The decoded map of a valid frame, to mutate."""
    body: dict[str, Any] = msgpack.unpackb(encode(msg), raw=False)
    return body


def pack(body: object) -> bytes:
    frame: bytes = msgpack.packb(body, use_bin_type=True)
    return frame


def rejected(frame: bytes, *, max_frame_bytes: int | None = None) -> str:
    """The ProtocolError message decoding ``frame`` raises."""
    kwargs = {} if max_frame_bytes is None else {"max_frame_bytes": max_frame_bytes}
    with pytest.raises(ProtocolError) as info:
        decode(frame, **kwargs)
    return str(info.value)


def test_protocol_error_is_a_radixserve_error() -> None:
    assert issubclass(ProtocolError, RadixServeError)


def test_unknown_keys_are_ignored_at_top_level_and_nested() -> None:
    body = body_of(PREFILL)
    body["future_field"] = {"nested": [1, 2, {"x": None}]}
    body["sampling"]["future_knob"] = 0.5
    assert decode(pack(body)) == PREFILL


def test_missing_optional_fields_take_defaults() -> None:
    body = {"type": "token_chunk", "v": [PROTOCOL_VERSION[0], 0], "request_id": "r"}
    assert decode(pack(body)) == TokenChunk("r")


def test_newer_minor_version_is_accepted() -> None:
    body = body_of(PREFILL)
    body["v"] = [PROTOCOL_VERSION[0], 99]
    assert decode(pack(body)) == PREFILL


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("token_ids", [1, "2", 3], "prefill_request.token_ids[1]: expected an int"),
        (
            "token_ids",
            [1, 2**31],
            "prefill_request.token_ids[1]: expected an int in [0, 2147483647]",
        ),
        ("token_ids", [], "prefill_request.token_ids: expected a list of 1.."),
        ("token_ids", "12", "prefill_request.token_ids: expected a list"),
        ("dst_page_ids", [3, -1], "prefill_request.dst_page_ids[1]: expected an int in [0,"),
        ("dst_page_ids", [True], "prefill_request.dst_page_ids[0]: expected an int"),
        (
            "num_cached_tokens",
            True,
            "prefill_request.num_cached_tokens: expected an int in [0, 9223372036854775807], got bool True",
        ),
        ("num_cached_tokens", 1.0, "prefill_request.num_cached_tokens: expected an int"),
        (
            "num_cached_tokens",
            None,
            "prefill_request.num_cached_tokens: expected an int in [0, 9223372036854775807], got nil",
        ),
        ("request_id", "", "prefill_request.request_id: expected a string of 1..256 characters"),
        ("request_id", "x" * 257, "prefill_request.request_id: expected a string of 1..256"),
        ("request_id", b"req-1", "prefill_request.request_id: expected a string, got bytes"),
        ("request_id", 5, "prefill_request.request_id: expected a string, got int"),
        ("sampling", [1], "prefill_request.sampling: expected a map, got list"),
        ("sampling", {"top_k": "4"}, "prefill_request.sampling.top_k: expected an int"),
        (
            "sampling",
            {"temperature": True},
            "prefill_request.sampling.temperature: expected a number",
        ),
        (
            "sampling",
            {"temperature": float("nan")},
            "prefill_request.sampling.temperature: expected a finite",
        ),
        (
            "sampling",
            {"top_p": 1.5},
            "prefill_request.sampling.top_p: expected a finite number in [0, 1]",
        ),
        (
            "sampling",
            {"seed": 2**64 - 1, "stop": ["a", 1]},
            "prefill_request.sampling.stop[1]: expected a string",
        ),
    ],
)
def test_bad_field_values_are_rejected_naming_the_field(
    field: str, value: object, expected: str
) -> None:
    body = body_of(PREFILL)
    body[field] = value
    assert expected in rejected(pack(body))


def test_missing_required_field_is_rejected() -> None:
    body = body_of(PREFILL)
    del body["dst_page_ids"]
    assert "prefill_request.dst_page_ids: missing required field" in rejected(pack(body))


@pytest.mark.parametrize(
    ("msg", "field", "value", "expected"),
    [
        (
            Hello("a", "decode"),
            "role",
            "router",
            "hello.role: expected one of ['decode', 'gateway'",
        ),
        (Hello("a", "decode"), "generation", -1, "hello.generation: expected an int in [0,"),
        (
            KVReady("r", (5,)),
            "first_token_ids",
            [],
            "kv_ready.first_token_ids: expected a list of 1..",
        ),
        (
            TokenChunk("r", (5,)),
            "ttft_ms",
            float("inf"),
            "token_chunk.ttft_ms: expected a finite number",
        ),
        (
            TokenChunk("r", (5,)),
            "ttft_ms",
            -1.0,
            "token_chunk.ttft_ms: expected a finite number in [0,",
        ),
        (Heartbeat("w"), "stats", {"tasks": True}, "heartbeat.stats.tasks: expected an int"),
        (Heartbeat("w"), "stats", {"uptime_s": -1.0}, "heartbeat.stats.uptime_s: expected a"),
        (
            Heartbeat("w"),
            "stats",
            {"engine": {"pages_cached": "3"}},
            "heartbeat.stats.engine.pages_cached: expected an int",
        ),
        (
            Heartbeat("w"),
            "stats",
            {"prefill": {"prefill_wait_seconds": {"bounds": [1.0], "counts": [1]}}},
            "one count per bound and one for +Inf",
        ),
        (
            IndexReply("q"),
            "device_pages",
            {"running": True},
            "index_reply.device_pages['running']: expected a number, got bool",
        ),
        (
            IndexReply("q"),
            "device_pages",
            {"running": {"a": 1}},
            "index_reply.device_pages['running']: expected a number",
        ),
        (
            IndexReply("q"),
            "device_pages",
            {"": 1},
            "index_reply.device_pages key: expected a string of 1..128",
        ),
        (
            IndexReply("q"),
            "device_pages",
            {f"k{i}": i for i in range(257)},
            "index_reply.device_pages: expected at most 256",
        ),
        (
            Heartbeat("w"),
            "load",
            {"queued_tokens": 1, "draining": 1},
            "heartbeat.load.draining: expected a bool",
        ),
        (
            MemberList(1, 1),
            "members",
            [{"name": "d", "role": "decode", "address": "tcp://x:1"}, {"name": "p"}],
            "member_list.members[1].role: missing required field",
        ),
        (
            TokenChunk("r"),
            "finish_reason",
            "eos",
            "token_chunk.finish_reason: expected one of ['abort'",
        ),
        (TokenChunk("r"), "ttft_ms", "1", "token_chunk.ttft_ms: expected a number, got str"),
    ],
)
def test_bad_values_in_other_messages(
    msg: Message, field: str, value: object, expected: str
) -> None:
    body = body_of(msg)
    body[field] = value
    assert expected in rejected(pack(body))


def test_contradictory_fields_are_rejected() -> None:
    body = body_of(PREFILL)
    body["num_cached_tokens"] = 5
    assert "prefill_request: num_cached_tokens=5 must be below len(token_ids)=5" in rejected(
        pack(body)
    )
    chunk = body_of(TokenChunk("r", finished=True, finish_reason="stop"))
    chunk["finish_reason"] = None
    assert "token_chunk: a finished chunk must have a finish_reason" in rejected(pack(chunk))


@pytest.mark.parametrize(
    ("patch", "expected"),
    [
        ({"type": "prefill"}, "unknown message type 'prefill'; known: ["),
        ({"type": "PrefillRequest"}, "unknown message type 'PrefillRequest'"),
        ({"type": 3}, "frame has no string 'type' tag (got int)"),
        ({"type": None}, "frame has no string 'type' tag (got nil)"),
        (
            {"v": [7, 0]},
            "peer speaks protocol version 7.0, this side 6.5: major versions must match",
        ),
        ({"v": [0, 9]}, "peer speaks protocol version 0.9"),
        ({"v": "1.0"}, "protocol version must be [major, minor], got '1.0'"),
        ({"v": [3, -1]}, "protocol version must be [major, minor]"),
        ({"v": [True, 0]}, "protocol version must be [major, minor]"),
        ({"v": None}, "protocol version must be [major, minor]"),
    ],
)
def test_bad_tag_or_version_is_rejected(patch: dict[str, object], expected: str) -> None:
    body = body_of(PREFILL)
    body.update(patch)
    assert expected in rejected(pack(body))


def test_missing_tag_or_version_is_rejected() -> None:
    body = body_of(PREFILL)
    del body["v"]
    assert "frame has no 'v' (protocol version)" in rejected(pack(body))
    body = body_of(PREFILL)
    del body["type"]
    assert "frame has no string 'type' tag (got nil)" in rejected(pack(body))


def test_oversized_frames_are_rejected_on_decode_and_encode() -> None:
    frame = encode(PREFILL)
    assert decode(frame, max_frame_bytes=len(frame)) == PREFILL
    assert f"frame of {len(frame)} bytes exceeds max_frame_bytes=100" in rejected(
        frame, max_frame_bytes=100
    )
    with pytest.raises(ProtocolError, match="encoded frame of .* exceeds max_frame_bytes=100"):
        encode(PREFILL, max_frame_bytes=100)


@pytest.mark.parametrize(
    ("frame", "expected"),
    [
        (pack([1, 2]), "frame must be a msgpack map, got list"),
        (pack(7), "frame must be a msgpack map, got int"),
        (pack(None), "frame must be a msgpack map, got nil"),
        (b"", "frame is not valid msgpack"),
        (b"\xc1", "frame is not valid msgpack"),
        (b"\x00\xff garbage \xde\xad", "frame is not valid msgpack"),
        (encode(PREFILL)[:-3], "frame is not valid msgpack"),
        (encode(PREFILL) + b"\x01", "frame is not valid msgpack: ExtraData"),
        (b"\x81\xa1a\xa2\xff\xfe", "frame is not valid msgpack"),  # invalid UTF-8 string
        (pack({1: "int key"}), "frame is not valid msgpack"),
    ],
)
def test_non_map_and_garbage_frames_are_rejected(frame: bytes, expected: str) -> None:
    assert expected in rejected(frame)


def test_non_bytes_frame_is_rejected() -> None:
    with pytest.raises(ProtocolError, match="frame must be bytes, got str"):
        decode("not bytes")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "ext", [msgpack.ExtType(5, b"payload"), msgpack.Timestamp(1, 0)], ids=["ext5", "timestamp"]
)
def test_msgpack_ext_types_are_rejected_in_fields_and_unknown_keys(ext: object) -> None:
    body = body_of(PREFILL)
    body["num_cached_tokens"] = ext
    assert "not allowed" in rejected(pack(body)) or "expected an int" in rejected(pack(body))
    body = body_of(PREFILL)
    body["future_field"] = [1, {"deep": ext}]
    message = rejected(pack(body))
    assert "ext type" in message
    if isinstance(ext, msgpack.Timestamp):
        assert "prefill_request.future_field: msgpack ext types are not allowed" in message


@pytest.mark.parametrize("depth", [1000, 100_000])
def test_deeply_nested_unknown_values_are_handled(depth: int) -> None:
    body = body_of(PREFILL)
    body["future_field"] = 0  # the last key: its packed value is the frame's last byte
    frame = pack(body)
    assert frame.endswith(b"\x00")
    deep = b"\x91" * depth + pack(msgpack.Timestamp(1, 0))  # [[[...[timestamp]...]]]
    message = rejected(frame[:-1] + deep)
    assert "prefill_request.future_field: msgpack ext types are not allowed" in message or (
        "not valid msgpack" in message
    )


def test_encode_rejects_invalid_messages_at_the_sender() -> None:
    bad = PrefillRequest("r", (1, 2), (-1,))
    with pytest.raises(ProtocolError, match=r"prefill_request.dst_page_ids\[0\]"):
        encode(bad)
    with pytest.raises(ProtocolError, match="token_chunk.finish_reason"):
        encode(TokenChunk("r", finished=True, finish_reason="done"))  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="cannot encode"):
        encode(Hello("\ud800", "decode"))  # a lone surrogate is not UTF-8


@dataclass(frozen=True)
class _Unregistered(Message):
    TYPE_TAG: ClassVar[str] = "hello"


def test_encode_rejects_unregistered_classes() -> None:
    with pytest.raises(ProtocolError, match="_Unregistered: not a registered message type"):
        encode(_Unregistered())


def test_long_token_lists_round_trip_and_locate_the_bad_item() -> None:
    tokens = list(range(200_000))
    request = GenerateRequest("r", tuple(tokens))
    assert decode(encode(request)) == request
    body = body_of(request)
    body["prompt_token_ids"][123_456] = -5
    assert "generate_request.prompt_token_ids[123456]: expected an int" in rejected(pack(body))


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_ever_raise_protocol_error(frame: bytes) -> None:
    with contextlib.suppress(ProtocolError):
        decode(frame)


values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text() | st.binary(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner, max_size=3),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(sorted(body_of(PREFILL))), values)
def test_any_value_in_any_field_decodes_or_raises_protocol_error(field: str, value: object) -> None:
    body = body_of(PREFILL)
    body[field] = value
    try:
        frame = pack(body)
    except (OverflowError, ValueError):
        return  # not representable in msgpack at all
    try:
        decoded = decode(frame)
    except ProtocolError:
        return
    assert encode(decoded)  # whatever decodes is valid for the sender as well


def test_bytes_fields_round_trip_and_reject_other_types() -> None:
    ack = HelloAck("prefill-0", "prefill", transfer_metadata=b"\x00\xff" * 9)
    assert decode(encode(ack)) == ack
    body = body_of(ack)
    body["transfer_metadata"] = "not bytes"
    assert "hello_ack.transfer_metadata: expected bytes" in rejected(pack(body))
    body["transfer_metadata"] = b"x" * ((1 << 20) + 1)
    assert "at most 1048576 bytes" in rejected(pack(body))


def test_page_hashes_travel_as_16_bytes_each_and_are_bounds_checked() -> None:
    """128-bit page hashes (wider than any msgpack int) go as one bin of 16 big-endian
    bytes per hash and come back as the same ints; a bin that is not whole hashes, a
    list past the spec's length, a value past 128 bits or a negative one is refused."""
    hashes = (0, 1, 2**64, 2**128 - 1)
    run = SpillRun(2, b"n" * 32, (2**127,))
    offer = SpillOffer(1, hashes, (0, 1, 2, 3), tuple(range(8)), (run, SpillRun(2, b"n" * 32)))
    body = body_of(offer)
    assert body["page_hashes"] == b"".join(h.to_bytes(16, "big") for h in hashes)
    assert decode(encode(offer)) == offer
    assert decode(encode(HostLookup("q", hashes))) == HostLookup("q", hashes)
    body["page_hashes"] = body["page_hashes"][:-1]
    assert "expected a multiple of 16 bytes" in rejected(pack(body))
    body = body_of(offer)
    body["runs"][0]["parent"] = b"\x01" * 32  # a parent is one hash at most
    assert "expected at most 1 page hashes, got 2" in rejected(pack(body))
    body = body_of(offer)
    body["page_hashes"] = list(hashes[:2])  # ints: an old peer's list
    assert "expected bytes (msgpack bin) of 16-byte page hashes" in rejected(pack(body))
    for bad in (2**128, -1):
        with pytest.raises(ProtocolError, match=r"page hashes in \[0, 2\*\*128\)"):
            encode(HostLookup("q", (bad,)))
    body = body_of(offer)
    body["token_ids"] = list(range(7))  # not a page size per page
    assert "7 tokens for 4 pages" in rejected(pack(body))


def _empty_maps_frame(num_bytes: int) -> bytes:
    """A frame of `num_bytes`: one msgpack array32 of empty maps (1 byte each)."""
    count = num_bytes - 5
    return b"\xdd" + count.to_bytes(4, "big") + b"\x80" * count


def test_a_64_mib_frame_of_empty_maps_is_refused_without_building_it() -> None:
    """64M empty maps would be ~4 GiB of dicts: the array's header is over the protocol's
    longest list, so nothing of it is built."""
    frame = _empty_maps_frame(DEFAULT_MAX_FRAME_BYTES)
    tracemalloc.start()
    try:
        message = rejected(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert f"exceeds max_array_len({FRAME_LIMITS.max_array_len})" in message
    assert peak < 50 << 20, f"decoding allocated {peak} bytes"


def test_nested_containers_past_the_frame_budget_are_refused() -> None:
    """Arrays of arrays each under the per-array limit still stop at the frame's budget
    of maps and of arrays (checked here with small budgets)."""
    limits = dataclasses.replace(FRAME_LIMITS, max_maps=1000, max_arrays=100)
    maps = msgpack.packb({"type": "x", "v": [1, 0], "junk": [[{}] * 600, [{}] * 600]})
    with pytest.raises(ProtocolError, match="more maps than any message"):
        decode(maps, limits=limits)
    arrays = msgpack.packb({"type": "x", "v": [1, 0], "junk": [[[]] * 60, [[]] * 60]})
    with pytest.raises(ProtocolError, match="more arrays than any message"):
        decode(arrays, limits=limits)
    assert decode(encode(PREFILL), limits=limits) == PREFILL  # a real message fits


def test_the_frame_limits_fit_the_largest_messages() -> None:
    """The per-type limits come from the specs: the longest token list, the most page
    hashes, the longest text decode; one more item is refused."""
    assert FRAME_LIMITS.max_array_len == MAX_TOKENS_PER_MESSAGE
    assert FRAME_LIMITS.max_bin_len == MAX_PAGES_PER_MESSAGE * HASH_BYTES
    assert FRAME_LIMITS.max_str_len == MAX_TEXT_CHARS * 4
    longest = dataclasses.replace(PREFILL, token_ids=(1,) * MAX_TOKENS_PER_MESSAGE)
    assert decode(encode(longest)) == longest
    too_long = msgpack.packb({"type": "x", "v": [1, 0], "x": [0] * (MAX_TOKENS_PER_MESSAGE + 1)})
    assert "exceeds max_array_len" in rejected(too_long)
