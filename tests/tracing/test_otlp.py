"""OTLP export through the OpenTelemetry SDK's exporters: spans sent over each protocol
(http/protobuf, http/json, grpc) to a real receiver in this process that decodes them
with opentelemetry-proto, with their resource, parents and headers; a collector that is
down costs requests nothing; the standard OTEL_* variables read as the specification
says, and a protocol not spoken refused by name."""

from __future__ import annotations

import socket

import pytest

from radixserve.tracing import OtlpExporter, OtlpSettings, Tracer, otlp_exporter
from tests.tracing.otlp_receiver import GrpcOtlpReceiver, OtlpReceiver

CONTENT_TYPES = {"http/protobuf": "application/x-protobuf", "http/json": "application/json",
                 "grpc": "application/grpc"}  # fmt: skip
REMOTE_PARENT = 0x300  # OTLP SpanFlags: the parent's is-remote bit is known, and set
LOCAL_PARENT = 0x100  # known, and not set


@pytest.fixture(params=list(CONTENT_TYPES))
def protocol(request):
    return request.param


@pytest.fixture
def receiver(protocol):
    running = GrpcOtlpReceiver() if protocol == "grpc" else OtlpReceiver()
    yield running
    running.close()


def test_spans_are_exported_with_their_resource(receiver, protocol, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint + "/")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-tenant=blue,authorization=Bearer%20k")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    tracer = Tracer("gateway", otlp_exporter("gateway"))
    assert tracer.enabled
    root = tracer.start_request("gateway.request")
    root.child("gateway.queue", prompt_tokens=7, ratio=0.5, worker="decode-0", hit=True).end()
    root.end()
    # a worker's span under the gateway's, and one under that: remote, then local parent
    worker = Tracer("decode", otlp_exporter("decode"))
    admission = worker.join(root.traceparent()).child("decode.admission")
    admission.child("decode.lookup").end()
    admission.end(error="refused")
    names = {"gateway.request", "gateway.queue", "decode.admission", "decode.lookup"}
    spans = receiver.wait_for(root.trace_id, names)
    tracer.close()
    worker.close()
    by_name = {s["name"]: s for s in spans}
    assert sorted(by_name) == sorted(names) and len(spans) == len(names)
    queue, request = by_name["gateway.queue"], by_name["gateway.request"]
    assert queue["parentSpanId"] == request["spanId"] == root.span_id
    assert "parentSpanId" not in request and request["kind"] == 2 and queue["kind"] == 1
    assert by_name["decode.admission"]["parentSpanId"] == root.span_id
    assert by_name["decode.admission"]["flags"] == REMOTE_PARENT
    assert by_name["decode.admission"]["status"]["code"] == 2  # STATUS_CODE_ERROR
    assert by_name["decode.admission"]["attributes"]["error"] == "refused"
    assert by_name["decode.lookup"]["parentSpanId"] == admission.span_id
    assert by_name["decode.lookup"]["flags"] == LOCAL_PARENT
    assert by_name["decode.lookup"]["resource"]["service.name"] == "radixserve-decode"
    assert request["scope"] == "radixserve"
    assert queue["attributes"] == {"prompt_tokens": 7, "ratio": 0.5, "worker": "decode-0",
                                   "hit": True}  # fmt: skip
    assert int(queue["endTimeUnixNano"]) >= int(queue["startTimeUnixNano"]) > 0
    resource = request["resource"]
    assert resource["service.name"] == "radixserve-gateway"
    assert resource["radixserve.role"] == "gateway"
    assert resource["deployment.environment"] == "test"
    path, headers, content_type = receiver.posts[0]
    assert path == ("TraceService/Export" if protocol == "grpc" else "/v1/traces")
    assert headers["x-tenant"] == "blue" and headers["authorization"] == "Bearer k"
    assert content_type == CONTENT_TYPES[protocol]


def test_a_stalled_collector_never_blocks_the_caller():
    """A collector that takes the connection and never answers holds the export thread;
    ending spans still returns at once (the queue is bounded: the surplus is dropped)."""
    with socket.socket() as stalled:
        stalled.bind(("127.0.0.1", 0))
        stalled.listen(8)  # connections complete in the backlog; nothing ever answers
        url = f"http://127.0.0.1:{stalled.getsockname()[1]}/v1/traces"
        exporter = OtlpExporter(url, {}, schedule_delay_s=0.01, timeout_s=60, max_queue=50,
                                max_batch=10)  # fmt: skip
        remote = Tracer("decode", exporter).join(
            Tracer("gateway", keep=True).start_request("r").traceparent()
        )
        for i in range(200):
            remote.child(f"s{i}").end()
        assert exporter.exported == exporter.failed == 0  # the first post is still waiting
        assert exporter.dropped >= 200 - 50 - 10
        exporter.close(timeout_s=0.1)  # gives up on the stalled post; the thread is a daemon


def test_a_collector_that_is_down_costs_a_failed_export():
    with socket.socket() as down:  # bound, never listening: held, and refuses connections
        down.bind(("127.0.0.1", 0))
        exporter = OtlpExporter(f"http://127.0.0.1:{down.getsockname()[1]}/v1/traces", {},
                                schedule_delay_s=0.01, timeout_s=5)  # fmt: skip
        tracer = Tracer("decode", exporter)
        remote = tracer.join(Tracer("gateway", keep=True).start_request("r").traceparent())
        for i in range(20):
            remote.child(f"s{i}").end()
        tracer.close()  # posts what is queued: refused, counted, not raised
    assert (exporter.exported, exporter.failed, exporter.dropped) == (0, 20, 0)


def test_the_endpoint_variables_follow_the_specification(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
                 "OTEL_SDK_DISABLED", "OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    assert OtlpSettings().traces_url() is None and otlp_exporter("decode") is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    assert OtlpSettings().traces_url() == "http://collector:4318/v1/traces"
    assert OtlpSettings().protocol() == "http/protobuf"  # the specification's default
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert OtlpSettings().traces_url() == "http://collector:4318"  # gRPC: as is
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")  # wins
    assert OtlpSettings().protocol() == "http/json"
    assert OtlpSettings().traces_url() == "http://collector:4318/v1/traces"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://other:9/custom")
    assert OtlpSettings().traces_url() == "http://other:9/custom"  # used as is
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert OtlpSettings().traces_url() is None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert OtlpSettings().traces_url() is None


def test_service_name_and_resource(monkeypatch):
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,team=infra")
    assert OtlpSettings().resource("prefill")["service.name"] == "from-attrs"
    monkeypatch.setenv("OTEL_SERVICE_NAME", "shop-llm")
    resource = OtlpSettings().resource("prefill")
    assert resource["service.name"] == "shop-llm"  # wins, as the specification says
    assert resource["radixserve.role"] == "prefill" and resource["team"] == "infra"
    monkeypatch.delenv("OTEL_SERVICE_NAME")
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES")
    assert OtlpSettings().resource("decode")["service.name"] == "radixserve-decode"


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_PROTOCOL",
                                      "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"])  # fmt: skip
def test_a_protocol_not_spoken_is_refused_by_name(monkeypatch, variable):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.setenv(variable, "bogus")  # refused with no endpoint too: before any request
    with pytest.raises(ValueError, match=f"^{variable}=bogus is not supported: use one of "
                                         "http/protobuf, http/json, grpc"):  # fmt: skip
        otlp_exporter("gateway")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://collector:4318")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TIMEOUT: .*integer"):
        otlp_exporter("gateway")
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TIMEOUT")
    for protocol, module in (("http/protobuf", "proto.http"), ("http/json", "json.http"),
                             ("grpc", "proto.grpc")):  # fmt: skip
        monkeypatch.setenv(variable, protocol)
        exporter = otlp_exporter("gateway")
        assert exporter is not None and exporter.protocol == protocol
        assert f"opentelemetry.exporter.otlp.{module}." in type(exporter._sdk).__module__
        exporter.close()
