"""`ServingMetrics`: cached prompt tokens split by the tier they came from."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from radixserve.engine.outputs import RequestOutput
from radixserve.metrics import RequestTimer, ServingMetrics


def cached_by_tier(metrics: ServingMetrics) -> dict[str, float]:
    text = metrics.render({}).decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "radixserve_cached_tokens"
    ]
    return {s.labels["tier"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_cached_tokens_are_counted_once_by_the_tier_they_came_from():
    """Every tier is exported from the start; a request with 96 cached tokens, 64 loaded
    through the kvstore and 48 of those read from its disk tier, counts 32 device, 16
    host and 48 disk tokens (RequestTimer passes the output's own counts)."""
    metrics = ServingMetrics()
    assert cached_by_tier(metrics) == {"device": 0.0, "host": 0.0, "disk": 0.0}
    out = RequestOutput("r", [1], "x", True, "stop", prompt_tokens=100, cached_tokens=96,
                        completion_tokens=1, ttft_ms=5.0, host_cached_tokens=64,
                        disk_cached_tokens=48)  # fmt: skip
    RequestTimer(metrics).finish(out, "stop")
    assert cached_by_tier(metrics) == {"device": 32.0, "host": 16.0, "disk": 48.0}
    metrics.record_finish(10, 8, 1, "stop", host_cached_tokens=4, disk_cached_tokens=9)
    assert cached_by_tier(metrics) == {"device": 36.0, "host": 16.0, "disk": 52.0}  # disk <= host
