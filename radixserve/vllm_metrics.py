"""vLLM's Prometheus names beside radixserve's own, for dashboards and tools built for vLLM.

Same names, types, meanings, buckets and label sets as vLLM v1's `PrometheusStatLogger`
(``vllm/v1/metrics/loggers.py``), each from the service that owns the number, so every
series has one source:

=======================================  ===========  =====================================
vLLM name (type)                         served by    radixserve's own figure
=======================================  ===========  =====================================
vllm:num_requests_running (gauge)        each worker  radixserve_worker_running
vllm:num_requests_waiting (gauge)        each worker  radixserve_worker_waiting
vllm:kv_cache_usage_perc (gauge, 0..1)   each worker  radixserve_worker_pages_{total,free,
                                                      evictable}
vllm:prefix_cache_queries_total          each worker  radixserve_worker_prefix_cache_
  (counter, tokens)                                   queried_tokens_total
vllm:prefix_cache_hits_total             each worker  radixserve_worker_prefix_cache_
  (counter, tokens)                                   hit_tokens_total
vllm:time_to_first_token_seconds (hist)  gateway      radixserve_ttft_seconds
vllm:inter_token_latency_seconds (hist)  gateway      radixserve_itl_seconds
vllm:lora_requests_info (gauge)          gateway      (the gateway's requests in flight)
=======================================  ===========  =====================================

Labels: ``model_name`` (the served model id) and, on the per-engine families, ``engine``:
vLLM's index of an engine within one server; one radixserve worker is one engine, and its
name is the label, so the workers' series stay apart wherever they are gathered. The
gateway times whole requests over every engine, so its histograms carry ``model_name``
only (a ``sum by (le)`` reads them as it reads vLLM's).

Meanings, as vLLM's: running/waiting are the engine's running batch and admission queue;
KV-cache usage is the share of pages held by requests (free and evictable cached pages are
not in use, as free-queue blocks are not in vLLM); prefix-cache queries and hits count the
prompt tokens looked up and found in the worker's own device cache at admission (pages
loaded from the kvstore's tiers are vLLM's "external" hits and are not counted here).
The latency histograms observe what ``radixserve_ttft_seconds`` / ``radixserve_itl_seconds``
observe (so their counts agree), in vLLM's buckets. ``vllm:lora_requests_info`` is set to
the scrape time, its lists the LoRA adapters of this gateway's requests in flight
(``waiting_lora_adapters``: before their first token, ``running_lora_adapters``: after
it; `LoraRequests`), and ``max_lora`` the engines' adapter slots (``max_loras``, as the
workers report it in ``radixserve_worker_lora_max``; "0" before any has).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.worker_metrics import Snapshot

if TYPE_CHECKING:
    from radixserve.protocol.link_messages import WorkerLoad
    from radixserve.protocol.stats_messages import EngineSection

#: vLLM v1's buckets for time to first token
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
#: vLLM v1's buckets for inter-token latency (those of time per output token)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0,
)  # fmt: skip
#: a worker's counters (`EngineSection` fields) behind vLLM's prefix-cache counters
QUERIED_TOKENS = "prefix_cache_queried_tokens_total"
HIT_TOKENS = "prefix_cache_hit_tokens_total"


def kv_cache_usage(stats: EngineSection) -> float:
    """The share of the pool's pages held by requests (0..1): neither free nor cached
    and evictable."""
    if stats.pages_total <= 0:
        return 0.0
    held = stats.pages_total - stats.pages_free - (stats.pages_evictable or 0)
    return min(max(held / stats.pages_total, 0.0), 1.0)


def engine_families(
    model_name: str, engine: str, load: WorkerLoad, stats: EngineSection
) -> Iterator[Any]:
    """vLLM's per-engine families from one worker's heartbeat numbers: its ``load``
    (running, waiting) and its engine's ``stats`` (the pool pages, the prefix-cache
    counters)."""
    labels, values = ["model_name", "engine"], [model_name, engine]
    for name, doc, value in (
        ("vllm:num_requests_running", "Number of requests in model execution batches.",
         load.running),
        ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
         load.waiting),
        ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
         kv_cache_usage(stats)),
    ):  # fmt: skip
        gauge = GaugeMetricFamily(name, doc, labels=labels)
        gauge.add_metric(values, float(value))
        yield gauge
    for name, doc, count in (
        ("vllm:prefix_cache_queries",
         "Prefix cache queries, in terms of number of queried tokens.",
         stats.prefix_cache_queried_tokens_total),
        ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
         stats.prefix_cache_hit_tokens_total),
    ):  # fmt: skip
        counter = CounterMetricFamily(name, doc, labels=labels)
        counter.add_metric(values, float(count))
        yield counter


def engine_metrics(model_name: str, engine: str, load: WorkerLoad, stats: EngineSection) -> bytes:
    """`engine_families` as the Prometheus text exposition (a worker's /metrics)."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(Snapshot(lambda _: engine_families(model_name, engine, load, stats)))
    return generate_latest(registry)


class LoraRequests(Collector):
    """``vllm:lora_requests_info``: the LoRA adapters of the requests in flight, those
    waiting for their first token and those past it (the gateway counts them: `waiting`
    when a request starts, `running` at its first token, `finished` at its end), and
    ``max_lora``, an engine's adapter slots (set before each scrape from the workers'
    ``lora_max``, `radixserve.metrics.lora_slots`)."""

    def __init__(self) -> None:
        self._waiting: Counter[str] = Counter()
        self._running: Counter[str] = Counter()
        self.max_lora = 0  # an engine's adapter slots, as its workers last said (0: unknown)

    def waiting(self, adapter: str) -> None:
        if adapter:
            self._waiting[adapter] += 1

    def running(self, adapter: str) -> None:
        if adapter:
            self._waiting[adapter] -= 1
            self._running[adapter] += 1

    def finished(self, adapter: str, running: bool) -> None:
        if adapter:
            (self._running if running else self._waiting)[adapter] -= 1

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        gauge = GaugeMetricFamily(
            "vllm:lora_requests_info", "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )  # fmt: skip
        waiting = ",".join(sorted(name for name, n in self._waiting.items() if n > 0))
        running = ",".join(sorted(name for name, n in self._running.items() if n > 0))
        gauge.add_metric([str(self.max_lora), waiting, running], time.time())
        yield gauge


class FrontMetrics:
    """The gateway's vLLM families, on ``registry``: the request latency histograms
    (observed beside radixserve's own, `radixserve.metrics.RequestTimer`) and the LoRA
    info gauge."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            ["model_name"], buckets=TTFT_BUCKETS, registry=registry,
        ).labels(model_name=model_name)  # fmt: skip
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            ["model_name"], buckets=ITL_BUCKETS, registry=registry,
        ).labels(model_name=model_name)  # fmt: skip
        self.lora = LoraRequests()
        registry.register(self.lora)
