"""One disaggregated request through a real cluster (gateway, decode and prefill
processes, KV over NIXL) is one trace: each process exports its own spans over OTLP to a
receiver in this test process, parented across the processes under the client's
``traceparent``; the gateway's /debug/traces holds the same spans without any backend.
Here over the default protocol, http/protobuf (OTEL_EXPORTER_OTLP_PROTOCOL unset);
test_tracing_protocols.py runs the same check over http/json and grpc."""

from __future__ import annotations

from typing import Any

from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.conftest import otlp_receiver
from tests.tracing.otlp_receiver import _Spans

SHARED_CLUSTER = "remote-tiny"  # shared with other modules: tests/cluster/conftest.py

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"
SECRET = "periwinkle marmalade"  # prompt text, which no span may hold
#: span name -> (the process that records it, the span it is a child of)
EXPECTED = {
    "gateway.request": ("gateway", None),
    "gateway.queue": ("gateway", "gateway.request"),
    "decode.admission": ("decode", "gateway.request"),
    "decode.remote_prefill": ("decode", "gateway.request"),
    "prefill.queue": ("prefill", "decode.remote_prefill"),
    "prefill.compute": ("prefill", "decode.remote_prefill"),
    "prefill.transfer": ("decode", "decode.remote_prefill"),  # timed where pages are read
    "decode.stream": ("decode", "gateway.request"),
}


def test_one_disaggregated_request_is_one_trace_across_the_processes(cluster):
    receiver = otlp_receiver()
    exported = check_one_trace(cluster, receiver)
    posts = [post for post in receiver.posts if post[0] == "/v1/traces"]
    assert {content_type for _, _, content_type in posts} == {"application/x-protobuf"}
    assert {s["resource"]["service.name"] for s in exported} == {
        "radixserve-gateway", "radixserve-decode", "radixserve-prefill"}  # fmt: skip


def check_one_trace(cluster: TestCluster, receiver: _Spans) -> list[dict[str, Any]]:
    """Send one traced disaggregated request through ``cluster`` and check its trace as
    ``receiver`` got it from the three processes, and as the gateway keeps it; the
    exported spans."""
    body = {"model": "default", "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": f"Tell me about {SECRET} today."}]}  # fmt: skip
    resp = cluster.http.post("/v1/chat/completions", json=body,
                             headers={"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"})  # fmt: skip
    assert resp.status_code == 200, resp.text
    assert resp.headers["traceparent"].startswith(f"00-{CLIENT_TRACE}-")

    exported = receiver.wait_for(CLIENT_TRACE, set(EXPECTED))
    names = [s["name"] for s in exported]
    assert sorted(names) == sorted(EXPECTED), names  # each once, in this one trace
    spans = {s["name"]: s for s in exported}
    for name, (role, parent) in EXPECTED.items():
        span = spans[name]
        assert span["resource"]["service.name"] == f"radixserve-{role}", (name, span["resource"])
        wanted = spans[parent]["spanId"] if parent else CLIENT_SPAN
        assert span["parentSpanId"] == wanted, name
        assert int(span["endTimeUnixNano"]) >= int(span["startTimeUnixNano"]) > 0
    assert spans["gateway.request"]["attributes"]["request_id"] == resp.json()["id"]
    assert spans["decode.admission"]["attributes"]["route"] == "remote"
    assert spans["prefill.compute"]["attributes"]["computed_tokens"] > 0
    assert spans["decode.stream"]["attributes"]["completion_tokens"] == 4
    assert spans["prefill.transfer"]["attributes"]["pages"] >= 1
    assert SECRET not in str(exported)

    # the gateway's own view: the same spans, carried back on the replies
    kept = cluster.http.get(f"/debug/traces/{CLIENT_TRACE}").json()
    assert kept["client_span_id"] == CLIENT_SPAN
    assert {(s["span_id"], s["parent_span_id"], s["name"], s["service"]) for s in kept["spans"]} == {
        (s["spanId"], None if s["name"] == "gateway.request" else s["parentSpanId"], s["name"],
         EXPECTED[s["name"]][0])
        for s in exported
    }  # fmt: skip
    assert SECRET not in str(kept)
    listed = cluster.http.get("/debug/traces", params={"limit": 20}).json()["traces"]
    [summary] = [t for t in listed if t["trace_id"] == CLIENT_TRACE]
    assert summary["span_count"] == len(EXPECTED)
    assert summary["request_id"] == resp.json()["id"]
    return exported
