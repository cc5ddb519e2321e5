"""The wire format's building blocks: field specs and the base classes of messages.

A message is a frozen dataclass whose every field carries a *wire spec* in its metadata
(`field_spec`): the type and bounds the codec (`radixserve.protocol.codec`) enforces on
encode and decode. `radixserve.protocol.messages` declares the messages with them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, ClassVar

INT64_MAX = 2**63 - 1
MAX_DURATION_MS = 1e12
MAX_TOKEN_ID = 2**31 - 1
MAX_TOKENS_PER_MESSAGE = 1 << 21
MAX_TEXT_CHARS = 1 << 20
HASH_BYTES = 16  # a page hash on the wire (`HashesSpec`): radixserve.cache.block_hash's

# --- wire specs: declarative bounds, interpreted by the codec -------------------------


@dataclass(frozen=True)
class IntSpec:
    """An int (never a bool) in ``[lo, hi]``."""

    lo: int = 0
    hi: int = INT64_MAX


@dataclass(frozen=True)
class FloatSpec:
    """A finite number (int accepted, bool not) in ``[lo, hi]``, held as float."""

    lo: float = 0.0
    hi: float = MAX_DURATION_MS


@dataclass(frozen=True)
class BoolSpec:
    """A bool."""


@dataclass(frozen=True)
class StrSpec:
    """A str of ``min_chars..max_chars`` characters, one of ``choices`` when given."""

    max_chars: int
    min_chars: int = 0
    choices: frozenset[str] | None = None


@dataclass(frozen=True)
class BytesSpec:
    """A msgpack bin of at most ``max_bytes`` bytes (opaque data such as agent metadata)."""

    max_bytes: int


@dataclass(frozen=True)
class HashesSpec:
    """Page hashes (`radixserve.cache.block_hash`: 128-bit ints, wider than a msgpack
    int): on the wire one bin of `HASH_BYTES` big-endian bytes per hash, at most
    ``max_len`` hashes; held as a tuple of ints."""

    max_len: int


@dataclass(frozen=True)
class ListSpec:
    """A list of ``min_len..max_len`` items, each matching ``item``; held as a tuple."""

    item: IntSpec | StrSpec | FloatSpec | NestedSpec
    max_len: int
    min_len: int = 0


@dataclass(frozen=True)
class OptionalSpec:
    """None (msgpack nil) or a value matching ``inner``."""

    inner: IntSpec | FloatSpec | StrSpec | NestedSpec


@dataclass(frozen=True)
class NestedSpec:
    """A map decoded into the wire struct ``cls`` (no type tag, no version)."""

    cls: type[WireStruct]


@dataclass(frozen=True)
class StatsSpec:
    """A flat map of str keys to ints or finite floats; held as a read-only mapping."""

    max_entries: int
    key: StrSpec
    value: IntSpec
    float_value: FloatSpec


WireSpec = (
    IntSpec
    | FloatSpec
    | BoolSpec
    | StrSpec
    | BytesSpec
    | HashesSpec
    | ListSpec
    | OptionalSpec
    | NestedSpec
    | StatsSpec
)


TOKEN_ID = IntSpec(0, MAX_TOKEN_ID)


def is_int(value: object) -> bool:
    """True for ints that are not bools (a JSON `true` must not pass as `1`)."""
    return isinstance(value, int) and not isinstance(value, bool)


def field_spec(spec: WireSpec) -> dict[str, WireSpec]:
    """Field metadata holding the wire spec of one field."""
    return {"wire": spec}


def wire_spec(f: dataclasses.Field[Any]) -> WireSpec:
    """The wire spec declared on dataclass field ``f``."""
    spec: WireSpec = f.metadata["wire"]
    return spec


_FIELDS: dict[type, tuple[tuple[dataclasses.Field[Any], WireSpec], ...]] = {}


def wire_fields(cls: type) -> tuple[tuple[dataclasses.Field[Any], WireSpec], ...]:
    """Each field of the wire struct ``cls`` with its spec, in order (read once a class:
    the codec and every construction walk them)."""
    fields = _FIELDS.get(cls)
    if fields is None:
        fields = _FIELDS[cls] = tuple((f, wire_spec(f)) for f in dataclasses.fields(cls))
    return fields


_NORMALISED: dict[type, tuple[tuple[str, type], ...]] = {}


def _normalised(cls: type) -> tuple[tuple[str, type], ...]:
    """The fields of ``cls`` that construction normalises (lists, stats, floats), each
    with its spec's type (read once a class)."""
    fields = _NORMALISED.get(cls)
    if fields is None:
        kinds = (ListSpec, StatsSpec, FloatSpec)
        fields = _NORMALISED[cls] = tuple(
            (f.name, type(spec)) for f, spec in wire_fields(cls) if isinstance(spec, kinds)
        )
    return fields


# --- base classes ---------------------------------------------------------------------


@dataclass(frozen=True)
class WireStruct:
    """Base of every wire struct: normalises containers after construction."""

    def __post_init__(self) -> None:
        for name, kind in _normalised(type(self)):
            value = getattr(self, name)
            if kind is ListSpec and isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
            elif kind is StatsSpec and isinstance(value, dict):
                object.__setattr__(self, name, MappingProxyType(dict(value)))
            elif kind is FloatSpec and type(value) is int:
                object.__setattr__(self, name, float(value))

    def invariant_error(self) -> str | None:
        """Why the fields contradict each other, or None; the codec rejects such values."""
        return None


@dataclass(frozen=True)
class Message(WireStruct):
    """A top-level message; ``TYPE_TAG`` is its stable name on the wire."""

    TYPE_TAG: ClassVar[str] = ""
