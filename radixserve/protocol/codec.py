"""Encode messages as msgpack maps and decode frames back, validating everything.

A frame is one msgpack map with string keys: ``"type"`` (the message's stable tag),
``"v"`` (``[major, minor]``) and one key per field; nested structs are maps without a
tag. Never pickle. Contracts:

- `decode` accepts only a frame of at most ``max_frame_bytes`` that stays within
  `FRAME_LIMITS` (per-type msgpack limits and a container budget computed from the
  messages' specs, `radixserve.protocol.frame_limits`), holding a map whose
  major version equals ours, whose tag is registered, whose required fields are present
  and whose fields all match their wire specs (`radixserve.protocol.messages`). Unknown
  keys are ignored (after checking they hold no msgpack ext values); missing optional
  fields take their defaults. Anything else raises `ProtocolError` saying what was wrong
  and where (``"prefill_request.dst_page_ids[3]: ..."``); no raw msgpack exception escapes.
- `encode` applies the same checks to the outgoing message, so a bad value fails at the
  sender, and raises `ProtocolError` as well.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgpack

from radixserve.errors import RadixServeError
from radixserve.protocol.frame_limits import FrameLimits, frame_limits
from radixserve.protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION
from radixserve.protocol.wire import (
    HASH_BYTES,
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
    WireSpec,
    WireStruct,
    is_int,
    wire_fields,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_FRAME_BYTES = 64 * 2**20
#: per-type msgpack limits and a per-frame container budget, from the messages' specs
FRAME_LIMITS = frame_limits(MESSAGE_TYPES.values())
_MAX_EXT_LEN = 16  # ext values are refused by name (`_reject_ext_hook`); a timestamp is 12
TYPE_KEY = "type"
VERSION_KEY = "v"

_S = TypeVar("_S", bound=WireStruct)


class ProtocolError(RadixServeError):
    """A frame or message breaks the wire protocol.

    ``identity`` is the sending peer's routing id when the frame came through a ROUTER
    socket (so the caller can answer or drop that peer), else None.
    """

    def __init__(self, message: str, *, identity: bytes | None = None) -> None:
        super().__init__(message)
        self.identity = identity


def encode(msg: Message, *, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> bytes:
    """The frame for ``msg``; raises `ProtocolError` if it is invalid or too large."""
    cls = type(msg)
    if MESSAGE_TYPES.get(cls.TYPE_TAG) is not cls:
        raise ProtocolError(f"cannot encode {cls.__name__}: not a registered message type")
    body = _struct_to_wire(msg)
    _check_struct(cls, body, cls.TYPE_TAG)
    body[TYPE_KEY] = cls.TYPE_TAG
    body[VERSION_KEY] = list(PROTOCOL_VERSION)
    try:
        frame: bytes = msgpack.packb(body, use_bin_type=True)
    except (ValueError, TypeError, OverflowError) as exc:  # e.g. a lone surrogate
        raise ProtocolError(f"{cls.TYPE_TAG}: cannot encode: {exc}") from exc
    if len(frame) > max_frame_bytes:
        raise ProtocolError(
            f"{cls.TYPE_TAG}: encoded frame of {len(frame)} bytes exceeds "
            f"max_frame_bytes={max_frame_bytes}"
        )
    return frame


def decode(
    frame: bytes | bytearray | memoryview,
    *,
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
    limits: FrameLimits | None = None,
) -> Message:
    """The message in ``frame``; raises `ProtocolError` on any violation (see module doc).
    `limits`: what the frame may make the decoder build (default: the protocol's,
    `FRAME_LIMITS`)."""
    if not isinstance(frame, bytes | bytearray | memoryview):
        raise ProtocolError(f"frame must be bytes, got {type(frame).__name__}")
    size = memoryview(frame).nbytes
    if size > max_frame_bytes:
        raise ProtocolError(f"frame of {size} bytes exceeds max_frame_bytes={max_frame_bytes}")
    body = _unpack(frame, FRAME_LIMITS if limits is None else limits)
    if not isinstance(body, dict):
        raise ProtocolError(f"frame must be a msgpack map, got {_kind(body)}")
    _check_version(body.get(VERSION_KEY, None), VERSION_KEY in body)
    tag = body.get(TYPE_KEY)
    if not isinstance(tag, str):
        raise ProtocolError(f"frame has no string {TYPE_KEY!r} tag (got {_kind(tag)})")
    cls = MESSAGE_TYPES.get(tag)
    if cls is None:
        raise ProtocolError(f"unknown message type {tag[:64]!r}; known: {sorted(MESSAGE_TYPES)}")
    return _check_struct(cls, body, tag, skip=(TYPE_KEY, VERSION_KEY))


class _ContainerBudget:
    """The msgpack hooks that count a frame's maps and arrays as they are built and stop
    the decode past `FrameLimits`' budget (the hooks return what they are given)."""

    def __init__(self, limits: FrameLimits) -> None:
        self._maps = limits.max_maps
        self._arrays = limits.max_arrays

    def map(self, value: dict[Any, Any]) -> dict[Any, Any]:
        self._maps -= 1
        if self._maps < 0:
            raise ProtocolError("frame holds more maps than any message (the protocol's "
                                "frame limits)")  # fmt: skip
        return value

    def array(self, value: list[Any]) -> list[Any]:
        self._arrays -= 1
        if self._arrays < 0:
            raise ProtocolError("frame holds more arrays than any message (the protocol's "
                                "frame limits)")  # fmt: skip
        return value


def _unpack(frame: bytes | bytearray | memoryview, limits: FrameLimits) -> object:
    """msgpack-decode ``frame`` within `limits` (each header checked before its value is
    built, then the container budget); every parse failure becomes `ProtocolError`."""
    # every map or array takes at least a byte: a frame no longer than the budget cannot
    # exceed it, and is decoded without the per-container hooks
    hooks: dict[str, Any] = {}
    if memoryview(frame).nbytes > min(limits.max_maps, limits.max_arrays):
        budget = _ContainerBudget(limits)
        hooks = {"object_hook": budget.map, "list_hook": budget.array}
    try:
        return msgpack.unpackb(
            frame, raw=False, ext_hook=_reject_ext_hook, strict_map_key=True,
            max_str_len=limits.max_str_len, max_bin_len=limits.max_bin_len,
            max_array_len=limits.max_array_len, max_map_len=limits.max_map_len,
            max_ext_len=_MAX_EXT_LEN, **hooks,
        )  # fmt: skip
    except ProtocolError:
        raise
    except Exception as exc:  # msgpack raises many types (ValueError, FormatError, ...)
        raise ProtocolError(f"frame is not valid msgpack: {type(exc).__name__}: {exc}") from exc


def _reject_ext_hook(code: int, data: bytes) -> object:
    raise ProtocolError(f"msgpack ext type {code} is not allowed in the protocol")


def _check_version(version: object, present: bool) -> None:
    if not present:
        raise ProtocolError(f"frame has no {VERSION_KEY!r} (protocol version)")
    if (
        not isinstance(version, list)
        or len(version) != 2
        or not all(is_int(part) and part >= 0 for part in version)
    ):
        raise ProtocolError(f"protocol version must be [major, minor], got {version!r:.80}")
    if version[0] != PROTOCOL_VERSION[0]:
        raise ProtocolError(
            f"peer speaks protocol version {version[0]}.{version[1]}, this side "
            f"{PROTOCOL_VERSION[0]}.{PROTOCOL_VERSION[1]}: major versions must match"
        )


def _check_struct(
    cls: type[_S], body: Mapping[Any, Any], where: str, skip: tuple[str, ...] = ()
) -> _S:
    """The ``cls`` instance described by the wire map ``body``, validated."""
    plan, names = _plan(cls)
    values: dict[str, Any] = {}
    for name, quick, spec, required in plan:
        if name in body:
            value = body[name]
            held = quick(value)
            values[name] = (
                held if held is not _DECLINED else _check_value(spec, value, f"{where}.{name}")
            )
        elif required:
            raise ProtocolError(f"{where}.{name}: missing required field")
    if len(body) > len(values) + sum(key in body for key in skip):  # a key not a field's
        for key, value in body.items():
            if key not in names and key not in skip:
                _reject_ext_values(value, f"{where}.{str(key)[:64]}")
    struct = cls(**values)
    problem = struct.invariant_error()
    if problem is not None:
        raise ProtocolError(f"{where}: {problem}")
    return struct


# --- compiled checks: the common values accepted in a few operations ------------------
#
# A field's quick check returns the value as the field holds it, or _DECLINED where it
# cannot tell at a glance (a value of another type, out of bounds, a non-empty list of
# structs...): `_check_value` then decides, and raises what it raises. A quick check
# accepts only what `_check_value` accepts, as it would hold it, so the two give the
# same struct and the same errors.

_DECLINED: Any = object()
_Quick = Callable[[object], Any]
_PLANS: dict[type, tuple[tuple[tuple[str, _Quick, WireSpec, bool], ...], frozenset[str]]] = {}


def _plan(
    cls: type[WireStruct],
) -> tuple[tuple[tuple[str, _Quick, WireSpec, bool], ...], frozenset[str]]:
    """Per field of ``cls``: its name, quick check, spec and whether it is required; and
    the field names (made once a class)."""
    made = _PLANS.get(cls)
    if made is None:
        fields = wire_fields(cls)
        plan = tuple(
            (f.name, _quick(spec), spec,
             f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
            for f, spec in fields
        )  # fmt: skip
        made = _PLANS[cls] = (plan, frozenset(f.name for f, _ in fields))
    return made


def _declined(value: object) -> Any:
    return _DECLINED


def _quick(spec: WireSpec) -> _Quick:
    """The quick check of ``spec`` (module notes above `_DECLINED`)."""
    if isinstance(spec, IntSpec):
        lo, hi = spec.lo, spec.hi
        return lambda v: v if type(v) is int and lo <= v <= hi else _DECLINED
    if isinstance(spec, FloatSpec):
        flo, fhi = spec.lo, spec.hi
        # v - v == 0 only for a finite v (inf - inf and NaN - NaN are NaN)
        return lambda v: v if type(v) is float and flo <= v <= fhi and v - v == 0 else _DECLINED
    if isinstance(spec, BoolSpec):
        return lambda v: v if v is True or v is False else _DECLINED
    if isinstance(spec, StrSpec):
        least, most, choices = spec.min_chars, spec.max_chars, spec.choices
        return lambda v: (
            v
            if type(v) is str and least <= len(v) <= most and (choices is None or v in choices)
            else _DECLINED
        )
    if isinstance(spec, OptionalSpec):
        inner = _quick(spec.inner)
        return lambda v: None if v is None else inner(v)
    if isinstance(spec, ListSpec):
        return _quick_list(spec)
    if isinstance(spec, NestedSpec):
        nested = spec.cls
        return lambda v: _quick_struct(nested, v) if type(v) is dict else _DECLINED
    return _declined  # bytes, hashes, stats: always `_check_value`


def _quick_list(spec: ListSpec) -> _Quick:
    least, most, item = spec.min_len, spec.max_len, spec.item
    if isinstance(item, IntSpec):
        lo, hi = item.lo, item.hi

        def ints(v: object) -> Any:
            if (
                type(v) is list
                and least <= len(v) <= most
                and all(type(x) is int and lo <= x <= hi for x in v)
            ):
                return tuple(v)
            return _DECLINED

        return ints
    each = _quick(item)

    def items(v: object) -> Any:
        if type(v) is not list or not least <= len(v) <= most:
            return _DECLINED
        held = tuple(each(x) for x in v)
        return _DECLINED if _DECLINED in held else held

    return items


def _quick_struct(cls: type[WireStruct], body: dict[Any, Any]) -> Any:
    """A nested struct from ``body`` when every field passes its quick check and it has
    no other key and breaks no invariant; else _DECLINED (`_check_struct` then says why)."""
    plan, _ = _plan(cls)
    values: dict[str, Any] = {}
    for name, quick, _spec, required in plan:
        if name in body:
            held = quick(body[name])
            if held is _DECLINED:
                return _DECLINED
            values[name] = held
        elif required:
            return _DECLINED
    if len(body) != len(values):
        return _DECLINED
    struct = cls(**values)
    return _DECLINED if struct.invariant_error() is not None else struct


def _check_value(spec: WireSpec, value: object, path: str) -> Any:
    """``value`` as the field should hold it, or `ProtocolError` naming ``path``."""
    if isinstance(spec, OptionalSpec):
        return None if value is None else _check_value(spec.inner, value, path)
    if isinstance(spec, IntSpec):
        if not isinstance(value, int) or isinstance(value, bool) or not spec.lo <= value <= spec.hi:
            raise _bad(path, f"an int in [{spec.lo}, {spec.hi}]", value)
        return value
    if isinstance(spec, FloatSpec):
        return _check_float(spec, value, path)
    if isinstance(spec, BoolSpec):
        if not isinstance(value, bool):
            raise _bad(path, "a bool", value)
        return value
    if isinstance(spec, StrSpec):
        return _check_str(spec, value, path)
    if isinstance(spec, BytesSpec):
        if not isinstance(value, bytes):
            raise _bad(path, "bytes (msgpack bin)", value)
        if len(value) > spec.max_bytes:
            raise ProtocolError(
                f"{path}: expected at most {spec.max_bytes} bytes, got {len(value)}"
            )
        return value
    if isinstance(spec, ListSpec):
        return _check_list(spec, value, path)
    if isinstance(spec, HashesSpec):
        return _check_hashes(spec, value, path)
    if isinstance(spec, NestedSpec):
        if not isinstance(value, dict):
            raise _bad(path, "a map", value)
        return _check_struct(spec.cls, value, path)
    return _check_stats(spec, value, path)


def _check_float(spec: FloatSpec, value: object, path: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool):
        raise _bad(path, "a number", value)
    number = float(value)
    if not math.isfinite(number) or not spec.lo <= number <= spec.hi:
        raise _bad(path, f"a finite number in [{spec.lo:g}, {spec.hi:g}]", value)
    return number


def _check_str(spec: StrSpec, value: object, path: str) -> str:
    if not isinstance(value, str):
        raise _bad(path, "a string", value)
    if not spec.min_chars <= len(value) <= spec.max_chars:
        raise ProtocolError(
            f"{path}: expected a string of {spec.min_chars}..{spec.max_chars} characters, "
            f"got {len(value)}"
        )
    if spec.choices is not None and value not in spec.choices:
        raise _bad(path, f"one of {sorted(spec.choices)}", value)
    return value


def _check_list(spec: ListSpec, value: object, path: str) -> tuple[Any, ...]:
    if not isinstance(value, list | tuple):
        raise _bad(path, "a list", value)
    if not spec.min_len <= len(value) <= spec.max_len:
        raise ProtocolError(
            f"{path}: expected a list of {spec.min_len}..{spec.max_len} items, got {len(value)}"
        )
    item = spec.item
    if isinstance(item, IntSpec):  # fast path for long token-id lists
        lo, hi = item.lo, item.hi
        if all(type(x) is int and lo <= x <= hi for x in value):
            return tuple(value)
    return tuple(_check_value(item, x, f"{path}[{i}]") for i, x in enumerate(value))


def _check_hashes(spec: HashesSpec, value: object, path: str) -> tuple[int, ...]:
    if not isinstance(value, bytes):
        raise _bad(path, f"bytes (msgpack bin) of {HASH_BYTES}-byte page hashes", value)
    count, rest = divmod(len(value), HASH_BYTES)
    if rest:
        raise ProtocolError(
            f"{path}: expected a multiple of {HASH_BYTES} bytes (page hashes), got {len(value)}"
        )
    if count > spec.max_len:
        raise ProtocolError(f"{path}: expected at most {spec.max_len} page hashes, got {count}")
    view = memoryview(value)
    return tuple(
        int.from_bytes(view[i : i + HASH_BYTES], "big") for i in range(0, len(value), HASH_BYTES)
    )


def _hashes_to_wire(value: object, path: str) -> bytes:
    """Page hashes (ints in ``[0, 2**128)``) as the bin `_check_hashes` reads."""
    limit = 1 << (8 * HASH_BYTES)
    if not isinstance(value, tuple | list) or not all(is_int(h) and 0 <= h < limit for h in value):
        raise _bad(path, f"a list of page hashes in [0, 2**{8 * HASH_BYTES})", value)
    return b"".join(h.to_bytes(HASH_BYTES, "big") for h in value)


def _check_stats(spec: StatsSpec, value: object, path: str) -> dict[str, int | float]:
    if not isinstance(value, Mapping):
        raise _bad(path, "a map", value)
    if len(value) > spec.max_entries:
        raise ProtocolError(
            f"{path}: expected at most {spec.max_entries} entries, got {len(value)}"
        )
    out: dict[str, int | float] = {}
    for key, item in value.items():
        name = _check_str(spec.key, key, f"{path} key")
        entry = f"{path}[{name!r}]"
        out[name] = (
            _check_value(spec.value, item, entry)
            if is_int(item)
            else _check_float(spec.float_value, item, entry)
        )
    return out


def _struct_to_wire(struct: WireStruct) -> dict[str, Any]:
    """The field map of ``struct`` in msgpack-ready containers (lists, dicts)."""
    body: dict[str, Any] = {}
    for f, spec in wire_fields(type(struct)):
        value = getattr(struct, f.name)
        kind = type(value)
        if isinstance(spec, HashesSpec):
            value = _hashes_to_wire(value, f"{type(struct).__name__}.{f.name}")
        elif kind is int or kind is str or kind is float or kind is bool or value is None:
            pass  # as it is
        elif isinstance(value, WireStruct):
            value = _struct_to_wire(value)
        elif isinstance(value, tuple):
            value = [_struct_to_wire(v) if isinstance(v, WireStruct) else v for v in value]
        elif isinstance(value, Mapping):
            value = dict(value)
        body[f.name] = value
    return body


def _reject_ext_values(value: object, path: str) -> None:
    """Raise if an ignored (unknown-key) value holds a msgpack ext such as a Timestamp.

    Iterative, so a deeply nested value cannot raise `RecursionError`.
    """
    pending = [value]
    while pending:
        item = pending.pop()
        if isinstance(item, msgpack.Timestamp | msgpack.ExtType):
            raise ProtocolError(f"{path}: msgpack ext types are not allowed in the protocol")
        if isinstance(item, list):
            pending.extend(item)
        elif isinstance(item, dict):
            pending.extend(item.values())


def _kind(value: object) -> str:
    """The msgpack-ish name of ``value``'s type, for error messages."""
    return "nil" if value is None else type(value).__name__


def _bad(path: str, expected: str, value: object) -> ProtocolError:
    if value is None:
        return ProtocolError(f"{path}: expected {expected}, got nil")
    shown = repr(value)
    if len(shown) > 80:
        shown = shown[:77] + "..."
    return ProtocolError(f"{path}: expected {expected}, got {_kind(value)} {shown}")
