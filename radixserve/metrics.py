"""Prometheus metrics of a serving front end, on a registry of their own.

Each `ServingMetrics` owns a `CollectorRegistry` (never the process-global default), so
several apps can live in one process (tests). Latencies are observed by `RequestTimer`
as outputs stream; pool gauges are refreshed from the engine's `stats()` at scrape time.

Metric names: radixserve_ttft_seconds, radixserve_itl_seconds, radixserve_e2e_seconds
(histograms); radixserve_prompt_tokens_total, radixserve_cached_tokens_total{tier} (tier: each of
`CachedTokens`' tiers, "device", "host", "disk", as it defines them),
radixserve_prefill_computed_tokens_total (= prompt - cached),
radixserve_generation_tokens_total, radixserve_requests_total{finish_reason} (counters);
radixserve_queue_depth, radixserve_gateway_queued_work_tokens,
radixserve_pages_{total,used,free,locked,evictable},
radixserve_live_requests (gauges); radixserve_cache_audit_total{result} (result "match",
"mismatch", "skipped": the engine's cache audit, `radixserve.engine.cache_audit`; behind
a cluster gateway per worker, with the ``worker`` and ``role`` labels) and
radixserve_cache_audit_fail_closed (1 while an engine serves nothing from its cache;
per worker: radixserve_worker_audit_fail_closed); radixserve_kv_identity_mismatch_total
(per worker and the kvstore: host- or disk-tier pages refused because their stored tokens
do not prove their hash or do not match the prompt's).

Behind a disaggregated gateway the workers' own numbers arrive in their heartbeats
(typed: `radixserve.protocol.stats_messages.ServiceStats`) and are exported per worker
(labels ``worker``, ``role``) by one table, `radixserve.worker_metrics.WORKER_METRICS`:
``radixserve_worker_<field>`` for each gauge (pages_used, pages_free, pages_locked,
live_requests, queued_tokens, ...), ``radixserve_worker_<field without _total>`` for
each counter (kv_transfer_pages_total, kv_transfer_bytes_total,
prefill_computed_tokens_total, ...), the prefill workers' histograms
(``prefill_wait_seconds``, ``prefill_request_tokens``), ``radixserve_worker_up``, and
``radixserve_kv_transfer_seconds`` (a summary: transfer count and total seconds).

Each service also serves its own numbers on its HTTP port
(`radixserve.worker_metrics.service_metrics`): the same
families with the same ``worker`` and ``role`` labels, one worker's worth. A Prometheus
that scrapes the pods therefore drops these families from its gateway scrape (the
compose and Kubernetes files do), so every series has one source and sums do not
double count; without Prometheus (`radixserve up`) the gateway's copy is the view.

vLLM's names (``vllm:*``) are exported beside these, each from one source: the request
latency histograms here, the per-engine gauges and counters from each worker's own
/metrics (`radixserve.vllm_metrics`).
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from radixserve.engine.outputs import RequestOutput
from radixserve.protocol.cached_tokens import TIERS, CachedTokens
from radixserve.protocol.stats_messages import HistogramStats
from radixserve.vllm_metrics import FrontMetrics
from radixserve.worker_metrics import (
    AUDIT_DOC,
    Snapshot,
    WorkerView,
    audit_results,
    worker_families,
)

logger = logging.getLogger(__name__)

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: the engine's pool gauges, summed over the workers behind a cluster gateway
POOL_GAUGES = (
    "pages_total", "pages_used", "pages_free", "pages_locked", "pages_evictable", "live_requests",
)  # fmt: skip

#: a prefill request's wait at its worker: the time to its first token less its own
#: compute (uncached tokens at the worker's measured prefill rate)
PREFILL_WAIT_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
)  # fmt: skip
#: a prefill request's uncached prompt tokens: 128 to 1M, a factor of sqrt(2) apart, fine
#: enough to tell which requests one replica can compute within a TTFT target
PREFILL_TOKENS_BUCKETS = tuple(float(round(128 * 2 ** (k / 2))) for k in range(27))

CONTENT_TYPE = CONTENT_TYPE_LATEST


class StatsHistogram:
    """A histogram a worker observes and carries in its heartbeat (`HistogramStats`); the
    gateway (and the worker's own /metrics) export it as ``radixserve_worker_<field>``."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, not cumulative; the last +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[next((i for i, b in enumerate(self.bounds) if value <= b), -1)] += 1
        self.sum += value

    def stats(self) -> HistogramStats:
        cumulative = tuple(itertools.accumulate(self.counts))
        return HistogramStats(self.bounds, cumulative, round(self.sum, 6))


class ServingMetrics:
    """Request latency and token metrics plus pool gauges, on `self.registry`; vLLM's
    request histograms (`radixserve.vllm_metrics.FrontMetrics`) labelled ``model_name``."""

    def __init__(self, model_name: str = "") -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.vllm = FrontMetrics(r, model_name)
        self.ttft = Histogram(
            "radixserve_ttft_seconds", "Time to first token.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "radixserve_itl_seconds", "Inter-token latency.", buckets=_ITL_BUCKETS, registry=r
        )
        self.e2e = Histogram(
            "radixserve_e2e_seconds", "Request latency.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.prompt_tokens = Counter(
            "radixserve_prompt_tokens", "Prompt tokens of finished requests.", registry=r
        )
        self.cached_tokens = Counter(
            "radixserve_cached_tokens",
            "Prompt tokens served from the prefix cache, by tier (device, host, disk).",
            ["tier"],
            registry=r,
        )
        for tier in TIERS:
            self.cached_tokens.labels(tier=tier)
        self.prefill_computed_tokens = Counter(
            "radixserve_prefill_computed_tokens",
            "Prompt tokens that ran through the model (prompt - cached).",
            registry=r,
        )
        self.generation_tokens = Counter(
            "radixserve_generation_tokens", "Generated tokens.", registry=r
        )
        self.requests = Counter(
            "radixserve_requests", "Finished requests.", ["finish_reason"], registry=r
        )
        # per LoRA adapter (requests naming one; the base model's are in the totals only)
        self.adapter_requests = Counter(
            "radixserve_lora_requests", "Finished requests, by LoRA adapter.", ["adapter"],
            registry=r,
        )  # fmt: skip
        self.adapter_prompt_tokens = Counter(
            "radixserve_lora_prompt_tokens", "Prompt tokens of finished requests, by LoRA "
            "adapter.", ["adapter"], registry=r,
        )  # fmt: skip
        self.adapter_cached_tokens = Counter(
            "radixserve_lora_cached_tokens", "Prompt tokens served from the prefix cache (every "
            "tier), by LoRA adapter: only its own pages.", ["adapter"], registry=r,
        )  # fmt: skip
        self.adapter_generation_tokens = Counter(
            "radixserve_lora_generation_tokens", "Generated tokens, by LoRA adapter.",
            ["adapter"], registry=r,
        )  # fmt: skip
        self.queue_depth = Gauge(
            "radixserve_queue_depth", "Generation requests in flight at the front end.", registry=r
        )
        self.queued_work = Gauge(
            "radixserve_gateway_queued_work_tokens",
            "Work of the generations in flight at the gateway: prompt tokens plus choices x "
            "max_tokens (bounded by max_queued_work_tokens).",
            registry=r,
        )
        self._pool = {
            key: Gauge(f"radixserve_{key}", f"Engine {key.replace('_', ' ')}.", registry=r)
            for key in POOL_GAUGES
        }
        self.refusals = Counter(
            "radixserve_refused_requests",
            "Requests the gateway's admission refused, by why: in_flight "
            "(max_queued_requests), capacity (max_queued_work_tokens), tenant_share, "
            "requests_per_minute, tokens_per_minute (429s); too_large (a 400: it could never "
            "be admitted).",
            ["reason"],
            registry=r,
        )
        self.aborted = Counter(
            "radixserve_gateway_aborted_requests",
            "Requests the gateway aborted before they finished, by why: disconnected (the "
            "client closed its connection, or it was cut), deadline (the request's timeout "
            "passed), too_slow (a stream's client fell stream_buffer_outputs behind).",
            ["reason"],
            registry=r,
        )
        self.cut_connections = Counter(
            "radixserve_gateway_cut_connections",
            "HTTP connections the gateway closed on its client, by why: header_timeout, "
            "body_timeout, write_stalled (nothing read for stream_idle_timeout_s), "
            "over_limit (past max_connections).",
            ["reason"],
            registry=r,
        )
        self._workers = Snapshot(worker_families)
        r.register(self._workers)
        self._front = Snapshot(_front_families)
        r.register(self._front)
        self._audit = Snapshot(_audit_families)  # the in-process engine's audit
        r.register(self._audit)

    def record_finish(
        self,
        prompt_tokens: int,
        cached: CachedTokens,
        completion_tokens: int,
        reason: str,
        adapter: str = "",
    ) -> None:
        """Count one finished (or aborted) request, its prompt's ``cached`` tokens by tier
        (and by LoRA ``adapter``, "" for the base model)."""
        self.prompt_tokens.inc(prompt_tokens)
        for tier, tokens in cached.by_tier().items():
            self.cached_tokens.labels(tier=tier).inc(tokens)
        self.prefill_computed_tokens.inc(max(prompt_tokens - cached.total, 0))
        self.generation_tokens.inc(completion_tokens)
        self.requests.labels(finish_reason=reason).inc()
        if adapter:
            self.adapter_requests.labels(adapter=adapter).inc()
            self.adapter_prompt_tokens.labels(adapter=adapter).inc(prompt_tokens)
            self.adapter_cached_tokens.labels(adapter=adapter).inc(cached.total)
            self.adapter_generation_tokens.labels(adapter=adapter).inc(completion_tokens)

    def render(
        self, stats: Mapping[str, int], workers: Mapping[str, WorkerView] | None = None
    ) -> bytes:
        """Prometheus text exposition, pool gauges refreshed from `stats` and per-worker
        families from `workers` (name -> the worker's link, load and stats) first."""
        for key, gauge in self._pool.items():
            if key in stats:
                gauge.set(stats[key])
        self._workers.snapshot = dict(workers or {})
        self.vllm.lora.max_lora = lora_slots(stats, workers or {})
        self._front.snapshot = {k: v for k, v in stats.items() if k in _FRONT_COUNTERS}
        self._audit.snapshot = {k: v for k, v in stats.items() if k.startswith("audit_")}
        return generate_latest(self.registry)


def lora_slots(stats: Mapping[str, int], workers: Mapping[str, WorkerView]) -> int:
    """The LoRA adapter slots of an engine: the most any worker up reports (its
    ``lora_max``; the pools share the setting), else the in-process engine's; 0 if none
    says."""
    slots = [view.stats.engine.lora_max for view in workers.values()
             if view.up and view.stats is not None and view.stats.engine is not None]  # fmt: skip
    return max(slots, default=stats.get("lora_max", 0))


#: counters the cluster client keeps (`ClusterClient.stats`): metric name and help
_FRONT_COUNTERS = {
    "gateway_migrations": (
        "radixserve_migrations",
        "Requests moved to another decode worker because theirs was lost or drained.",
    ),
    "gateway_prompt_hashes": (
        "radixserve_gateway_prompt_hashes",
        "Prompts whose pages the gateway hashed to route them (one per request and move).",
    ),
}


def _front_families(snapshot: dict[str, int]) -> Iterator[Any]:
    """The cluster client's own counters."""
    for key, value in sorted(snapshot.items()):
        name, doc = _FRONT_COUNTERS[key]
        yield CounterMetricFamily(name, doc, value=value)


def _audit_families(stats: dict[str, Any]) -> Iterator[Any]:
    """The in-process engine's cache audit (nothing while it is off)."""
    if "audit_checked" not in stats:
        return
    family = CounterMetricFamily("radixserve_cache_audit", AUDIT_DOC, labels=["result"])
    for result, count in audit_results(float(stats["audit_checked"]),
                                       float(stats.get("audit_mismatches", 0)),
                                       float(stats.get("audit_skipped", 0))):  # fmt: skip
        family.add_metric([result], count)
    yield family
    yield GaugeMetricFamily(
        "radixserve_cache_audit_fail_closed", _FAIL_CLOSED_DOC,
        value=float(stats.get("audit_fail_closed", 0)),
    )  # fmt: skip


_FAIL_CLOSED_DOC = "1 while a failed-closed cache audit keeps the engine off its cache."


class RequestTimer:
    """Times one request's stream: TTFT at the first token, ITL between tokens, E2E.

    Call `tokens(n)` whenever n new tokens arrive and `finish(...)` once at the end.
    """

    def __init__(
        self, metrics: ServingMetrics, start: float | None = None, adapter: str = ""
    ) -> None:
        self._metrics, self._adapter = metrics, adapter
        self._start = time.perf_counter() if start is None else start
        self._last: float | None = None

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.perf_counter()
        if self._last is None:
            self._metrics.ttft.observe(now - self._start)
            self._metrics.vllm.ttft.observe(now - self._start)
            n -= 1
        else:
            gap = (now - self._last) / n
            for _ in range(n):
                self._metrics.itl.observe(gap)
                self._metrics.vllm.itl.observe(gap)
        self._last = now

    def finish(self, last: RequestOutput, reason: str) -> None:
        """The request ended (``reason``); ``last`` is its latest output (the counts)."""
        self._metrics.e2e.observe(time.perf_counter() - self._start)
        self._metrics.record_finish(last.prompt_tokens, last.cached, last.completion_tokens, reason,
                                    self._adapter)  # fmt: skip
