"""`ServingMetrics`: cached prompt tokens split by the tier they came from."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from radixserve.engine.outputs import RequestOutput
from radixserve.metrics import RequestTimer, ServingMetrics
from radixserve.protocol.cached_tokens import CachedTokens


def cached_by_tier(metrics: ServingMetrics) -> dict[str, float]:
    text = metrics.render({}).decode()
    (family,) = [
        f for f in text_string_to_metric_families(text) if f.name == "radixserve_cached_tokens"
    ]
    return {s.labels["tier"]: s.value for s in family.samples if s.name.endswith("_total")}


def test_cached_tokens_are_counted_once_by_the_tier_they_came_from():
    """Every tier is exported from the start; a request with 32 device, 16 host and 48
    disk tokens cached counts each under its tier (RequestTimer passes the output's own
    counts), and the computed tokens are the prompt's others."""
    metrics = ServingMetrics()
    assert cached_by_tier(metrics) == {"device": 0.0, "peer": 0.0, "host": 0.0, "disk": 0.0}
    out = RequestOutput("r", [1], "x", True, "stop", prompt_tokens=100, completion_tokens=1,
                        ttft_ms=5.0, cached=CachedTokens(device=32, host=16, disk=48))  # fmt: skip
    RequestTimer(metrics).finish(out, "stop")
    assert cached_by_tier(metrics) == {"device": 32.0, "peer": 0.0, "host": 16.0, "disk": 48.0}
    metrics.record_finish(10, CachedTokens(peer=2, host=4, disk=4), 1, "stop")
    assert cached_by_tier(metrics) == {"device": 32.0, "peer": 2.0, "host": 20.0, "disk": 52.0}
    text = metrics.render({}).decode()
    assert "radixserve_prefill_computed_tokens_total 4.0" in text  # (100 - 96) + (10 - 10)
