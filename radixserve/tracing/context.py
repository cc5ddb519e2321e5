"""W3C trace context: the ``traceparent`` header, parsed and formatted.

``traceparent`` is ``version-trace_id-parent_id-flags`` in lowercase hex
(https://www.w3.org/TR/trace-context/#traceparent-header), e.g.
``00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01``. A header that breaks the
format (wrong lengths, uppercase, all-zero ids, version ``ff``, extra fields on version
00) is ignored, as the specification asks: the receiver starts a new trace instead, and
never fails the request over it.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

MAX_HEADER_CHARS = 512  # longer values are not parsed at all
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?")
_ZERO_TRACE = "0" * 32
_ZERO_SPAN = "0" * 16
_SAMPLED = 0x01

# ids need to be unique, not unpredictable: the standard library's generator (as the
# OpenTelemetry SDK uses) costs well under a microsecond, os.urandom several
_ids = random.Random()


@dataclass(frozen=True)
class TraceContext:
    """A span in another process (or the client) that spans here continue from."""

    trace_id: str  # 32 lowercase hex digits, not all zero
    span_id: str  # 16 lowercase hex digits, not all zero
    sampled: bool = True

    def traceparent(self) -> str:
        return format_traceparent(self.trace_id, self.span_id, self.sampled)


def parse_traceparent(value: str | None) -> TraceContext | None:
    """The context in a ``traceparent`` value; None if absent or malformed."""
    if not value or len(value) > MAX_HEADER_CHARS:
        return None
    match = _TRACEPARENT.fullmatch(value.strip(" \t"))
    if match is None:
        return None
    version, trace_id, span_id, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest is not None):
        return None
    if trace_id == _ZERO_TRACE or span_id == _ZERO_SPAN:
        return None
    return TraceContext(trace_id, span_id, bool(int(flags, 16) & _SAMPLED))


def format_traceparent(trace_id: str, span_id: str, sampled: bool = True) -> str:
    """The version-00 ``traceparent`` naming span ``span_id`` of trace ``trace_id``."""
    return f"00-{trace_id}-{span_id}-{'01' if sampled else '00'}"


def new_trace_id() -> str:
    """A random, non-zero 128-bit trace id in hex."""
    return f"{_ids.getrandbits(128) or 1:032x}"


def new_span_id() -> str:
    """A random, non-zero 64-bit span id in hex."""
    return f"{_ids.getrandbits(64) or 1:016x}"
