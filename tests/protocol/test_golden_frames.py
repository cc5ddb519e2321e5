"""Golden wire frames: every message type's frame, as this version encodes it, checked
into `tests/protocol/golden/frames.json`. A key renamed, retyped, dropped or added, or a
`PROTOCOL_VERSION` change, makes a frame differ from its golden bytes and fails here
(the round-trip tests of `test_messages` cannot see it: they use the same codec both
ways); so does a decoder that no longer reads what an older peer of this version sends.

Each message is built deterministically from its fields' wire specs (`sample`): every
field set, values inside their bounds. After an intended wire change, bump
`PROTOCOL_VERSION` as `radixserve.protocol.messages` says, then rewrite the file with
``python -m tests.protocol.test_golden_frames`` and review its diff."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from radixserve.protocol.codec import decode, encode
from radixserve.protocol.host_messages import SpillOffer, SpillRun
from radixserve.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION
from radixserve.protocol.stats_messages import HistogramStats  # noqa: E402
from radixserve.protocol.wire import (
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

GOLDEN = Path(__file__).parent / "golden" / "frames.json"


def value(spec: Any, name: str) -> Any:
    """A value of ``spec`` (for the field ``name``), inside its bounds, every time the same."""
    if isinstance(spec, BoolSpec):
        return True
    if isinstance(spec, IntSpec):
        return min(max(spec.lo, 3), spec.hi)
    if isinstance(spec, FloatSpec):
        return min(max(spec.lo, 1.5), spec.hi)
    if isinstance(spec, StrSpec):
        if spec.choices:
            return sorted(spec.choices)[0]
        return (name[:1] or "s") * max(spec.min_chars, min(spec.max_chars, 3))
    if isinstance(spec, BytesSpec):
        return bytes(range(1, 1 + min(spec.max_bytes, 4)))
    if isinstance(spec, HashesSpec):
        return (1, 2**127 + 5)[: spec.max_len]
    if isinstance(spec, ListSpec):
        return tuple(value(spec.item, name) for _ in range(max(spec.min_len, min(spec.max_len, 4))))
    if isinstance(spec, OptionalSpec):
        return value(spec.inner, name)
    if isinstance(spec, NestedSpec):
        return sample(spec.cls)
    if isinstance(spec, StatsSpec):
        return {"count": 7, "rate": 2.5}
    raise TypeError(f"{name}: no sample for {type(spec).__name__}")


def sample(cls: type[WireStruct]) -> Any:
    """``cls`` with every field set from its wire spec; where its own checks tie fields
    together beyond their specs, values that agree (named here, message by message)."""
    fields = {f.name: value(f.metadata["wire"], f.name) for f in dataclasses.fields(cls)}
    if cls is SpillOffer:  # a run per stretch of its pages; their tokens may be left out
        fields.update(page_hashes=(1, 2**127 + 5), buffer_page_ids=(3, 4), token_ids=(),
                      runs=(SpillRun(2, b"\x01" * 32, ()),))  # fmt: skip
    if cls is HistogramStats:  # a count per bound and one for +Inf
        fields.update(bounds=(0.5, 1.5), counts=(1, 2, 3))
    return cls(**fields)


def frames() -> dict[str, str]:
    """Every message type's frame, hex, by tag."""
    return {tag: encode(sample(cls)).hex() for tag, cls in sorted(MESSAGE_TYPES.items())}


def golden() -> dict[str, Any]:
    return json.loads(GOLDEN.read_text())


def test_the_golden_file_is_this_protocol_version_and_every_message_type():
    stored = golden()
    assert stored["version"] == list(PROTOCOL_VERSION), (
        "PROTOCOL_VERSION changed: rewrite the golden frames (module docstring)"
    )
    assert set(stored["frames"]) == set(MESSAGE_TYPES)


@pytest.mark.parametrize("tag", sorted(MESSAGE_TYPES))
def test_a_message_encodes_to_its_golden_frame_and_decodes_from_it(tag: str):
    stored = golden()["frames"]
    if tag not in stored:
        pytest.fail(f"{tag}: no golden frame (a new message type: rewrite the file)")
    msg: Message = sample(MESSAGE_TYPES[tag])
    frame = bytes.fromhex(stored[tag])
    assert decode(frame) == msg, f"{tag}: the golden frame no longer decodes to its message"
    assert encode(msg) == frame, f"{tag}: its frame changed (a key renamed, retyped, added?)"


if __name__ == "__main__":
    GOLDEN.write_text(json.dumps({"version": list(PROTOCOL_VERSION), "frames": frames()},
                                 indent=1, sort_keys=True) + "\n")  # fmt: skip
    print(f"wrote {len(MESSAGE_TYPES)} frames to {GOLDEN}", file=sys.stderr)
