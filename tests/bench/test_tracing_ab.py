"""The tracing benchmark's in-process parts: one traced request's spans as the three
processes make them (the contract's names, carried through the codec, kept whole by the
trace store), and its timers. (The cluster A/B itself runs as `bench/tracing_ab.py`.)"""

from __future__ import annotations

from radixserve.bench.tracing_ab import (
    _traced_request,
    traced_request_ns,
    untraced_calls_ns,
)
from radixserve.services.gateway.server.trace_store import TraceStore
from radixserve.services.gateway.tenancy.tenants import ANONYMOUS
from radixserve.tracing import Tracer


def test_a_traced_request_is_kept_whole():
    store = TraceStore(2)
    tracers = (Tracer("gateway", keep=True, max_spans=1024), Tracer("decode"), Tracer("prefill"))
    root = _traced_request(tracers, store)
    body = store.trace(root.trace_id, ANONYMOUS)
    assert body is not None
    services = {s["name"]: s["service"] for s in body["spans"]}
    assert services == {
        "gateway.request": "gateway", "gateway.queue": "gateway",
        "decode.admission": "decode", "decode.remote_prefill": "decode",
        "prefill.queue": "prefill", "prefill.compute": "prefill",
        "prefill.transfer": "decode", "decode.stream": "decode",
    }  # fmt: skip
    ids = {s["span_id"] for s in body["spans"]}
    assert all(s["parent_span_id"] in ids for s in body["spans"] if s["name"] != "gateway.request")


def test_the_timers_measure_something():
    traced, export = traced_request_ns(repeats=3)
    assert traced > 0 and export > 0
    assert untraced_calls_ns(repeats=10) > 0
