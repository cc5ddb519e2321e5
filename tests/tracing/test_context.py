"""W3C ``traceparent``: valid headers parse, every malformed one is ignored (a new
trace starts instead), and what is formatted parses back."""

from __future__ import annotations

import pytest

from radixserve.tracing import TraceContext, format_traceparent, parse_traceparent
from radixserve.tracing.context import new_span_id, new_trace_id

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"


def test_a_valid_header_parses_with_its_sampled_flag():
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-01") == TraceContext(TRACE, SPAN, True)
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-00") == TraceContext(TRACE, SPAN, False)
    # other flag bits are kept out of the sampled decision
    assert parse_traceparent(f"00-{TRACE}-{SPAN}-03") == TraceContext(TRACE, SPAN, True)
    # a later version may append fields; its first four are read
    assert parse_traceparent(f"01-{TRACE}-{SPAN}-01-extra") == TraceContext(TRACE, SPAN, True)


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        f"00-{TRACE}-{SPAN}",  # no flags
        f"00-{TRACE.upper()}-{SPAN}-01",  # uppercase hex
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"ff-{TRACE}-{SPAN}-01",  # the forbidden version
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE[:-1]}-{SPAN}-01",  # short trace id
        f"00-{TRACE}-{SPAN}x-01",  # long parent id
        f"0-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-1",
        f"00_{TRACE}_{SPAN}_01",
        f"00-{TRACE}-{SPAN}-01" + "-x" * 300,  # over the length parsed at all
    ],
)
def test_a_malformed_header_is_ignored(value):
    assert parse_traceparent(value) is None


def test_formatted_contexts_parse_back_and_ids_are_fresh():
    trace_ids = {new_trace_id() for _ in range(100)}
    span_ids = {new_span_id() for _ in range(100)}
    assert len(trace_ids) == len(span_ids) == 100
    for trace_id, span_id in zip(trace_ids, span_ids, strict=True):
        value = format_traceparent(trace_id, span_id)
        assert value == f"00-{trace_id}-{span_id}-01"
        assert parse_traceparent(value) == TraceContext(trace_id, span_id, True)
    assert format_traceparent(TRACE, SPAN, sampled=False).endswith("-00")
