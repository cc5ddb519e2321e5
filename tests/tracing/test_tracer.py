"""The per-process recorder: spans parented as started, kept in the request's trace,
carried across the wire and adopted on the other side, bounded; off (or an unsampled
parent) gives `NO_SPAN`, on which every call does nothing."""

from __future__ import annotations

from radixserve.protocol import decode, encode
from radixserve.protocol.messages import MAX_SPANS_PER_MESSAGE, KVReady
from radixserve.tracing import NO_SPAN, TraceContext, Tracer, parse_traceparent

CLIENT = TraceContext("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7")


def test_off_gives_no_span_and_records_nothing():
    tracer = Tracer("gateway")
    assert not tracer.enabled
    span = tracer.start_request("gateway.request", CLIENT)
    assert span is NO_SPAN and not span.recording
    child = span.child("gateway.queue", tokens=3)
    child.end()
    assert child is NO_SPAN and span.traceparent() == "" and span.records() == ()
    assert Tracer("decode").join("") is NO_SPAN
    assert Tracer("decode").join("00-garbage") is NO_SPAN


def test_an_unsampled_client_is_not_traced():
    tracer = Tracer("gateway", keep=True)
    unsampled = TraceContext(CLIENT.trace_id, CLIENT.span_id, sampled=False)
    assert tracer.start_request("gateway.request", unsampled) is NO_SPAN
    assert Tracer("decode").join(unsampled.traceparent()) is NO_SPAN


def test_spans_are_parented_kept_and_continue_the_clients_trace():
    root = Tracer("gateway", keep=True).start_request("gateway.request", CLIENT)
    assert root.recording and root.trace_id == CLIENT.trace_id
    assert root.parent_span_id == CLIENT.span_id and root.kind == "server"
    queue = root.child("gateway.queue", decode_worker="decode-0")
    queue.end(prompt_tokens=12)
    queue.end(prompt_tokens=99)  # a second end changes nothing
    root.end(RuntimeError("boom"))
    assert [s.name for s in root.trace.spans] == ["gateway.queue", "gateway.request"]
    assert queue.parent_span_id == root.span_id and queue.end_ns >= queue.start_ns > 0
    assert queue.attributes == {"decode_worker": "decode-0", "prompt_tokens": 12}
    assert root.status == "error" and root.attributes["error"] == "boom"
    assert parse_traceparent(root.traceparent()) == TraceContext(root.trace_id, root.span_id)


def test_worker_spans_cross_the_wire_and_are_adopted():
    root = Tracer("gateway", keep=True).start_request("gateway.request")
    remote = Tracer("decode").join(root.traceparent())
    assert remote.recording and remote.trace_id == root.trace_id
    admission = remote.child("decode.admission", prompt_tokens=40)
    admission.end(route="remote", cached=True)
    reply = KVReady("r1", (5,), spans=remote.records())
    [record] = decode(encode(reply)).spans  # type: ignore[attr-defined]
    assert record.parent_span_id == root.span_id and record.service == "decode"
    assert dict(record.values) == {"prompt_tokens": 40, "cached": 1}
    assert [(label.key, label.value) for label in record.labels] == [("route", "remote")]
    root.adopt([record])
    [adopted] = root.trace.spans
    assert (adopted.span_id, adopted.name, adopted.service) == (admission.span_id,
                                                                "decode.admission", "decode")  # fmt: skip
    assert adopted.attributes == {"prompt_tokens": 40, "cached": 1, "route": "remote"}
    assert (adopted.start_ns, adopted.end_ns) == (admission.start_ns, admission.end_ns)


def test_a_trace_holds_a_bounded_number_of_spans():
    remote = Tracer("decode").join(Tracer("gateway", keep=True).start_request("x").traceparent())
    for i in range(MAX_SPANS_PER_MESSAGE + 5):
        remote.child(f"step{i}").end()
    assert len(remote.trace.spans) == MAX_SPANS_PER_MESSAGE and remote.trace.dropped == 5
    assert len(remote.records()) == MAX_SPANS_PER_MESSAGE
