"""The codec's quick checks (`codec._quick`): each accepts only values the general check
(`_check_value`) accepts, and holds them as it would, for every wire spec of every
message; the nested-struct check likewise against `_check_struct`."""

from __future__ import annotations

import math
from typing import Any

import hypothesis.strategies as st
import msgpack
import pytest
from hypothesis import given, settings

from radixserve.protocol import codec
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.codec import ProtocolError, decode, encode
from radixserve.protocol.messages import MESSAGE_TYPES, TokenChunk
from radixserve.protocol.wire import (
    ListSpec,
    NestedSpec,
    OptionalSpec,
    StrSpec,
    WireSpec,
    wire_fields,
)


def _specs() -> list[WireSpec]:
    """Every spec reachable from the registered messages, nested ones included."""
    seen: dict[int, WireSpec] = {}
    pending: list[Any] = [NestedSpec(cls) for cls in MESSAGE_TYPES.values()]
    while pending:
        spec = pending.pop()
        if id(spec) in seen:
            continue
        seen[id(spec)] = spec
        if isinstance(spec, NestedSpec):
            pending.extend(s for _, s in wire_fields(spec.cls))
        elif isinstance(spec, ListSpec):
            pending.append(spec.item)
        elif isinstance(spec, OptionalSpec):
            pending.append(spec.inner)
    return list(seen.values())


SPECS = _specs()
CORPUS: list[Any] = [
    None, True, False, 0, 1, -1, 7, 2**31 - 1, 2**31, 2**63 - 1, 2**64, 0.0, -0.0, 1.5,
    -2.5, 1e12, 1e13, math.inf, -math.inf, math.nan, "", "a", "stop", "length", "x" * 70,
    "x" * 5000, b"", b"ab", [], [1, 2], [0], [-1], [1, "a"], [True], [1.0], ["a", "b"],
    [{}], [None], (1, 2), (), {}, {"a": 1},
]  # fmt: skip


def _same(quick: Any, general: Any) -> bool:
    """Equal and held alike (a float not an int, tuples of the same element types)."""
    if type(quick) is not type(general):
        return False
    if isinstance(quick, tuple):
        return len(quick) == len(general) and all(map(_same, quick, general))
    if isinstance(quick, float) and math.isnan(quick):
        return math.isnan(general)
    return bool(quick == general)


def _agrees(spec: WireSpec, value: Any) -> None:
    held = codec._quick(spec)(value)
    if held is codec._DECLINED:
        return
    general = codec._check_value(spec, value, "f")  # must not raise: the quick check took it
    assert _same(held, general), (spec, value, held, general)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: type(s).__name__)
def test_each_quick_check_takes_only_what_the_general_check_takes(spec: WireSpec):
    values = list(CORPUS)
    if isinstance(spec, StrSpec) and spec.choices:
        values += sorted(spec.choices)
    for value in values:
        _agrees(spec, value)


json_like = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**65), 2**65) | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(
            st.sampled_from(["index", "text", "hit", "x", "token_id"]), inner, max_size=4
        )
    ),  # fmt: skip
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(spec=st.sampled_from(SPECS), value=json_like)
def test_quick_checks_agree_on_arbitrary_values(spec: WireSpec, value: Any):
    _agrees(spec, value)


def test_a_token_chunk_decodes_through_the_quick_checks_and_a_bad_field_is_still_named():
    chunk = TokenChunk(request_id="r-1", token_ids=(5, 6), text="hi", prompt_tokens=9)
    frame = encode(chunk)
    assert decode(frame) == chunk
    body = codec._unpack(frame, codec.FRAME_LIMITS)
    body["completion_tokens"] = True  # a bool is no count: declined, then refused by name
    with pytest.raises(ProtocolError, match=r"token_chunk\.completion_tokens: expected an int"):
        decode(msgpack.packb(body))
    body["completion_tokens"] = 3
    body["cached"] = {"device": 4, "surprise": 2}  # an unknown nested key: the general check
    decoded = decode(msgpack.packb(body))
    assert decoded.completion_tokens == 3 and decoded.cached == CachedTokens(device=4)
    body["cached"] = {"device": -4}
    with pytest.raises(ProtocolError, match=r"token_chunk\.cached\.device"):
        decode(msgpack.packb(body))
