"""How much a frame may make the decoder build: per-type msgpack limits and a per-frame
budget of containers, computed from the messages' own wire specs so they follow the
protocol (the largest legitimate message decodes; nothing larger is built).

Why both: msgpack checks each string, bin, array and map header against its limit
before allocating it, so one 64M-element array is refused at its header; but
containers nest, and an array of empty maps costs 1 byte a map on the wire and ~64 in
memory, so a 64 MiB frame of arrays of empty maps would still build gigabytes. The
budget counts every map and array as it is built and stops the decode past the most
any message holds.

The numbers, for the protocol as declared in `radixserve.protocol.messages`:

* ``max_array_len``: the longest list field, 2**21 token ids (`MAX_TOKENS_PER_MESSAGE`);
* ``max_bin_len``: 16 MiB, a message's page hashes (2**20 pages x 16 bytes);
* ``max_str_len``: 4 MiB, the longest text field (2**20 characters) in UTF-8;
* ``max_map_len``: 256 (a worker's load stats) plus `UNKNOWN_KEYS` (the fields a newer
  minor version may add to a struct; for a stats map, so one a little over its bound is
  refused by the field check, which names it);
* ``max_maps``: ~4.2M and ``max_arrays``: ~8.4M, a token chunk's or KV-ready's
  per-token log-probabilities at the longest token list (2**21 tokens, two maps and
  four arrays each); a spill offer's 2**20 runs come next.

So a frame can make the decoder build at most ~4.2M maps and ~8.4M arrays (some
hundreds of MB of empty ones) instead of 64M; tighter still needs decoding directed by
the message's schema (the tag first, then each field as its spec says).

Both budgets get `UNKNOWN_CONTAINERS` more for the fields of newer peers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

from radixserve.protocol.wire import (
    HASH_BYTES,
    BytesSpec,
    HashesSpec,
    ListSpec,
    Message,
    NestedSpec,
    OptionalSpec,
    StatsSpec,
    StrSpec,
    WireSpec,
    WireStruct,
    wire_spec,
)

UNKNOWN_KEYS = 64  # fields a newer minor version may add to one struct
UNKNOWN_CONTAINERS = 1024  # maps (and arrays) those fields may hold, per frame
_UTF8_MAX = 4  # bytes per character
_HEADER_KEYS = 2  # "type" and "v"


@dataclass(frozen=True)
class FrameLimits:
    """What one decoded frame may hold (see the module docstring)."""

    max_str_len: int  # bytes of one string
    max_bin_len: int  # bytes of one bin
    max_array_len: int  # items of one array
    max_map_len: int  # entries of one map
    max_maps: int  # maps in the whole frame
    max_arrays: int  # arrays in the whole frame


@dataclass
class _Tally:
    str_len: int = 0
    bin_len: int = 0
    array_len: int = 2  # the version, [major, minor]
    map_len: int = 0

    def spec(self, spec: WireSpec) -> tuple[int, int]:
        """(maps, arrays) one value of `spec` holds at most; widens the per-type maxima."""
        if isinstance(spec, OptionalSpec):
            return self.spec(spec.inner)
        if isinstance(spec, StrSpec):
            self.str_len = max(self.str_len, spec.max_chars * _UTF8_MAX)
        elif isinstance(spec, BytesSpec):
            self.bin_len = max(self.bin_len, spec.max_bytes)
        elif isinstance(spec, HashesSpec):
            self.bin_len = max(self.bin_len, spec.max_len * HASH_BYTES)
        elif isinstance(spec, ListSpec):
            self.array_len = max(self.array_len, spec.max_len)
            maps, arrays = self.spec(spec.item)
            return spec.max_len * maps, 1 + spec.max_len * arrays
        elif isinstance(spec, NestedSpec):
            return self.struct(spec.cls)
        elif isinstance(spec, StatsSpec):
            self.spec(spec.key)
            # the slack lets a map a little over reach the field check, which names it
            self.map_len = max(self.map_len, spec.max_entries + UNKNOWN_KEYS)
            return 1, 0
        return 0, 0

    def struct(self, cls: type[WireStruct], header: int = 0) -> tuple[int, int]:
        fields = dataclasses.fields(cls)
        self.map_len = max(self.map_len, len(fields) + header + UNKNOWN_KEYS)
        maps, arrays = 1, 1 if header else 0  # the struct's own map (and the version)
        for f in fields:
            field_maps, field_arrays = self.spec(wire_spec(f))
            maps, arrays = maps + field_maps, arrays + field_arrays
        return maps, arrays


def frame_limits(message_types: Iterable[type[Message]]) -> FrameLimits:
    """The limits under which every message of `message_types` decodes at its largest."""
    tally = _Tally()
    counts = [tally.struct(cls, _HEADER_KEYS) for cls in message_types]
    return FrameLimits(
        max_str_len=tally.str_len,
        max_bin_len=tally.bin_len,
        max_array_len=tally.array_len,
        max_map_len=tally.map_len,
        max_maps=max(maps for maps, _ in counts) + UNKNOWN_CONTAINERS,
        max_arrays=max(arrays for _, arrays in counts) + UNKNOWN_CONTAINERS,
    )
