"""The trace of one disaggregated request reaches a collector over each protocol the
OpenTelemetry SDKs speak besides the default (test_tracing.py: http/protobuf): a cluster
of the tiny model per protocol, every process exporting to a receiver in this process
that decodes with opentelemetry-proto (an HTTP server for http/json, a gRPC server for
grpc), parented as over the default."""

from __future__ import annotations

import pytest

from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.test_tracing import check_one_trace
from tests.tracing.otlp_receiver import GrpcOtlpReceiver, OtlpReceiver


@pytest.mark.parametrize(("protocol", "content_type"),
                         [("http/json", "application/json"), ("grpc", "application/grpc")])  # fmt: skip
def test_one_trace_over_each_protocol(tiny_model, protocol, content_type):
    receiver = GrpcOtlpReceiver() if protocol == "grpc" else OtlpReceiver()
    cluster = None
    try:
        cluster = TestCluster(
            transport="nixl",
            model=tiny_model,
            decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},  # every prompt prefilled remotely
            env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                "OTEL_EXPORTER_OTLP_PROTOCOL": protocol,
                "OTEL_BSP_SCHEDULE_DELAY": "200",
            },
        )
        exported = check_one_trace(cluster, receiver)
    finally:
        if cluster is not None:
            cluster.stop()
        receiver.close()
    assert {s["resource"]["service.name"] for s in exported} == {
        "radixserve-gateway", "radixserve-decode", "radixserve-prefill"}  # fmt: skip
    assert {post[2] for post in receiver.posts} == {content_type}
