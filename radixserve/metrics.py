"""Prometheus metrics of a serving front end, on a registry of their own.

Each `ServingMetrics` owns a `CollectorRegistry` (never the process-global default), so
several apps can live in one process (tests). Latencies are observed by `RequestTimer`
as outputs stream; pool gauges are refreshed from the engine's `stats()` at scrape time.

Metric names: radixserve_ttft_seconds, radixserve_itl_seconds, radixserve_e2e_seconds
(histograms); radixserve_prompt_tokens_total, radixserve_cached_tokens_total{tier} (tier
"device": the worker's own cache; "host": loaded from the kvstore's host tier; "disk":
read from the kvstore's disk tier, through host memory),
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

Behind a disaggregated gateway the workers' own numbers arrive in their heartbeats and
are exported per worker (labels ``worker``, ``role``): ``radixserve_worker_<key>`` for
each gauge (pages_used, pages_free, pages_locked, live_requests, queued_tokens, ...),
``radixserve_worker_<key>_total`` for each counter (kv_transfer_pages_total,
kv_transfer_bytes_total, prefill_computed_tokens_total, ...), ``radixserve_worker_<name>``
histograms carried as `StatsHistogram` keys (a prefill worker's per-request
``prefill_wait_seconds`` and ``prefill_request_tokens``), ``radixserve_worker_up``,
and ``radixserve_kv_transfer_seconds`` (a summary: transfer count and total seconds).

Each service also serves its own numbers on its HTTP port (`service_metrics`): the same
families with the same ``worker`` and ``role`` labels, one worker's worth. A Prometheus
that scrapes the pods therefore drops these families from its gateway scrape (the
compose and Kubernetes files do), so every series has one source and sums do not
double count; without Prometheus (`radixserve up`) the gateway's copy is the view.

vLLM's names (``vllm:*``) are exported beside these, each from one source: the request
latency histograms here, the per-engine gauges and counters from each worker's own
/metrics (`radixserve.vllm_metrics`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from radixserve.engine.outputs import RequestOutput, cached_by_tier
from radixserve.vllm_metrics import FrontMetrics

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
    """A histogram a worker carries in its heartbeat's flat ``stats``: the cumulative
    count under ``<name>:le=<bound>`` (the last ``+Inf``) and the sum under
    ``<name>:sum``. The gateway (and the worker's own /metrics) export it as the
    histogram ``radixserve_worker_<name>`` (`_worker_families`)."""

    def __init__(self, name: str, bounds: tuple[float, ...]) -> None:
        self.name = name
        self.bounds = (*bounds, float("inf"))
        self.counts = [0] * len(self.bounds)  # per bucket, not cumulative
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[next(i for i, b in enumerate(self.bounds) if value <= b)] += 1
        self.sum += value

    def stats(self) -> dict[str, int | float]:
        out: dict[str, int | float] = {}
        below = 0
        for bound, count in zip(self.bounds, self.counts, strict=True):
            below += count
            out[f"{self.name}:le={floatToGoString(bound)}"] = below
        out[f"{self.name}:sum"] = round(self.sum, 6)
        return out


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
        for tier in ("device", "host", "disk"):
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
        self._workers = _Snapshot(_worker_families)
        r.register(self._workers)
        self._front = _Snapshot(_front_families)
        r.register(self._front)
        self._audit = _Snapshot(_audit_families)  # the in-process engine's audit
        r.register(self._audit)

    def record_finish(
        self,
        prompt_tokens: int,
        cached_tokens: int,
        completion_tokens: int,
        reason: str,
        host_cached_tokens: int = 0,
        disk_cached_tokens: int = 0,
    ) -> None:
        """Count one finished (or aborted) request; ``host_cached_tokens`` of its
        ``cached_tokens`` came through the kvstore, ``disk_cached_tokens`` of those from
        its disk tier (the rest from host memory)."""
        device, host, disk = cached_by_tier(cached_tokens, host_cached_tokens, disk_cached_tokens)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.labels(tier="device").inc(device)
        self.cached_tokens.labels(tier="host").inc(host)
        self.cached_tokens.labels(tier="disk").inc(disk)
        self.prefill_computed_tokens.inc(max(prompt_tokens - cached_tokens, 0))
        self.generation_tokens.inc(completion_tokens)
        self.requests.labels(finish_reason=reason).inc()

    def render(
        self, stats: Mapping[str, int], workers: Mapping[str, Mapping[str, Any]] | None = None
    ) -> bytes:
        """Prometheus text exposition, pool gauges refreshed from `stats` and per-worker
        families from `workers` (name -> heartbeat stats with "role" and "up") first."""
        for key, gauge in self._pool.items():
            if key in stats:
                gauge.set(stats[key])
        self._workers.snapshot = dict(workers or {})
        self._front.snapshot = {k: v for k, v in stats.items() if k in _FRONT_COUNTERS}
        self._audit.snapshot = {k: v for k, v in stats.items() if k.startswith("audit_")}
        return generate_latest(self.registry)


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


class _Snapshot(Collector):
    """Exports families made at scrape time from ``snapshot`` (set before each scrape)."""

    def __init__(
        self, families: Callable[[dict[str, Any]], Iterator[Any]], snapshot: dict | None = None
    ) -> None:
        self.snapshot: dict[str, Any] = snapshot or {}
        self._families = families

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        return self._families(self.snapshot)


def _front_families(snapshot: dict[str, int]) -> Iterator[Any]:
    """The cluster client's own counters."""
    for key, value in sorted(snapshot.items()):
        name, doc = _FRONT_COUNTERS[key]
        yield CounterMetricFamily(name, doc, value=value)


#: the cache audit's counters in an engine's stats, by the result they count; matches
#: are the audits checked less those that did not match
_AUDIT_COUNTERS = ("audit_checked", "audit_mismatches", "audit_skipped")
#: a worker's (or the kvstore's) count of stored KV pages refused because their tokens
#: did not prove their hash (`radixserve.cache.page_proof`)
IDENTITY_MISMATCH = "kv_identity_mismatch_total"
_NOT_EXPORTED = frozenset(
    {"role", "address", "up", "generation", IDENTITY_MISMATCH, *_AUDIT_COUNTERS}
)


def _audit_results(stats: Mapping[str, Any]) -> list[tuple[str, float]]:
    """(result, count) of the cache audit in one engine's ``stats``; none if it is off."""
    if "audit_checked" not in stats:
        return []
    mismatches = float(stats.get("audit_mismatches", 0))
    return [
        ("match", float(stats["audit_checked"]) - mismatches),
        ("mismatch", mismatches),
        ("skipped", float(stats.get("audit_skipped", 0))),
    ]


def _audit_families(stats: dict[str, Any]) -> Iterator[Any]:
    """The in-process engine's cache audit (nothing while it is off)."""
    results = _audit_results(stats)
    if not results:
        return
    family = CounterMetricFamily("radixserve_cache_audit", _AUDIT_DOC, labels=["result"])
    for result, count in results:
        family.add_metric([result], count)
    yield family
    yield GaugeMetricFamily(
        "radixserve_cache_audit_fail_closed", _FAIL_CLOSED_DOC,
        value=float(stats.get("audit_fail_closed", 0)),
    )  # fmt: skip


_AUDIT_DOC = "Cache hits recomputed without the cache, by result (match, mismatch, skipped)."
_FAIL_CLOSED_DOC = "1 while a failed-closed cache audit keeps the engine off its cache."


def _worker_families(snapshot: dict[str, Mapping[str, Any]]) -> Iterator[Any]:
    """The latest per-worker stats as labelled families."""
    labels = ["worker", "role"]
    families: dict[str, Any] = {}
    up = GaugeMetricFamily("radixserve_worker_up", "1 while the worker is up.", labels=labels)
    transfer = SummaryMetricFamily(
        "radixserve_kv_transfer_seconds", "KV page transfers into the worker.", labels=labels
    )
    audit = CounterMetricFamily("radixserve_cache_audit", _AUDIT_DOC, labels=[*labels, "result"])
    mismatch = CounterMetricFamily(
        "radixserve_kv_identity_mismatch",
        "KV pages of the host or disk tier refused because their stored tokens do not "
        "prove their hash or do not match the prompt's (dropped, recomputed).",
        labels=labels,
    )
    for name, stats in sorted(snapshot.items()):
        ids = [name, str(stats.get("role", ""))]
        up.add_metric(ids, 1.0 if stats.get("up") else 0.0)
        if IDENTITY_MISMATCH in stats:
            mismatch.add_metric(ids, float(stats[IDENTITY_MISMATCH]))
        for result, count in _audit_results(stats):
            audit.add_metric([*ids, result], count)
        if "kv_transfers_total" in stats:
            transfer.add_metric(
                ids, stats["kv_transfers_total"], stats.get("kv_transfer_seconds_total", 0.0)
            )
        _add_histograms(families, ids, stats)
        for key, value in stats.items():
            if key in _NOT_EXPORTED or ":" in key or not isinstance(value, int | float):
                continue
            if key.endswith("_total"):
                base = f"radixserve_worker_{key[: -len('_total')]}"
                family = families.get(base) or CounterMetricFamily(
                    base, f"Worker counter {key}.", labels=labels
                )
            else:
                base = f"radixserve_worker_{key}"
                family = families.get(base) or GaugeMetricFamily(
                    base, f"Worker {key.replace('_', ' ')}.", labels=labels
                )
            families[base] = family
            family.add_metric(ids, float(value))
    yield up
    yield transfer
    if audit.samples:
        yield audit
    if mismatch.samples:
        yield mismatch
    yield from families.values()


def _add_histograms(families: dict[str, Any], ids: list[str], stats: Mapping[str, Any]) -> None:
    """The `StatsHistogram`s among one worker's ``stats``, added to ``families``."""
    buckets: dict[str, list[tuple[str, float]]] = {}
    for key, value in stats.items():
        name, sep, part = key.partition(":le=")
        if sep and isinstance(value, int | float):
            buckets.setdefault(name, []).append((part, float(value)))
    for name, points in buckets.items():
        base = f"radixserve_worker_{name}"
        family = families.get(base) or HistogramMetricFamily(
            base, f"Worker histogram {name}.", labels=["worker", "role"]
        )
        families[base] = family
        points.sort(key=lambda p: float(p[0]))  # "+Inf" sorts last
        family.add_metric(ids, points, float(stats.get(f"{name}:sum", 0.0)))


def service_metrics(name: str, role: str, stats: Mapping[str, Any]) -> bytes:
    """One service's own ``radixserve_worker_*`` families (its heartbeat numbers,
    ``stats``), labelled ``worker=name, role=role``, as the Prometheus text exposition."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(_Snapshot(_worker_families, {name: {**stats, "role": role, "up": True}}))
    return generate_latest(registry)


class RequestTimer:
    """Times one request's stream: TTFT at the first token, ITL between tokens, E2E.

    Call `tokens(n)` whenever n new tokens arrive and `finish(...)` once at the end.
    """

    def __init__(self, metrics: ServingMetrics, start: float | None = None) -> None:
        self._metrics = metrics
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
        self._metrics.record_finish(
            last.prompt_tokens, last.cached_tokens, last.completion_tokens, reason,
            last.host_cached_tokens, last.disk_cached_tokens,
        )  # fmt: skip
