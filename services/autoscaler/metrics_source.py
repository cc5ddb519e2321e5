"""Where the autoscaler's observations come from: the gateway's /metrics, or Prometheus.

Both build the same `Observation` (`policy`), from the same series:

* latency: the gateway's ``radixserve_ttft_seconds`` and ``radixserve_itl_seconds``
  histograms, p90 over the interval (bucket counts' change, linear within a bucket);
* requests/s: ``radixserve_requests_total``;
* per worker (``radixserve_worker_*{worker, role}``, the workers' heartbeats as the
  gateway exports them, named by the one table `radixserve.worker_metrics.WORKER_METRICS`):
  ``up``, ``draining``, ``uptime_s``, ``queued_tokens``, ``running``, the engine's
  step counters (`radixserve.engine.step_stats`) — the `WorkerSample`s capacity is
  learned from (`SAMPLE_FIELDS`, read the same way from either source) — and its LoRA
  adapter slots (``lora_waiting_requests``: requests waiting for a slot; ``lora_max``);
* demand: prompt tokens the workers computed per second plus the growth of the prefill
  queue (what arrived, even when the pool could not keep up), and tokens generated per
  second;
* per request, from the prefill workers' histograms ``radixserve_worker_prefill_request_tokens``
  (uncached prompt tokens) and ``radixserve_worker_prefill_wait_seconds`` (the wait
  around a request's own compute): their change over the interval, summed over the
  pool — what `feasibility` splits into infeasible requests and the feasible ones'
  queueing.

`GatewayMetrics` scrapes the text exposition each interval and takes differences from
the previous scrape (the first one only sets the baseline); `PrometheusMetrics` asks a
Prometheus server's HTTP query API for rates and quantiles over ``prometheus_window_s``.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from radixserve.services.autoscaler.capacity import WorkerSample
from radixserve.services.autoscaler.histogram import Histogram
from radixserve.services.autoscaler.observation import ROLES, Observation, PoolState
from radixserve.worker_metrics import WORKER_UP, WorkerMetric, worker_metric

logger = logging.getLogger(__name__)

Labels = tuple[tuple[str, str], ...]  # sorted
Key = tuple[str, Labels]  # sample name, labels

#: each measured `WorkerSample` field -> the worker's number it is read from: a
#: counter's change over the interval, a gauge's value
SAMPLE_FIELDS: dict[str, WorkerMetric] = {
    "busy_s": worker_metric("engine_busy_seconds_total"),
    "prefill_tokens": worker_metric("engine_prefill_tokens_total"),
    "prefill_s": worker_metric("engine_prefill_seconds_total"),
    "decode_tokens": worker_metric("engine_decode_tokens_total"),
    "decode_only_steps": worker_metric("engine_decode_only_steps_total"),
    "decode_only_seqs": worker_metric("engine_decode_only_seqs_total"),
    "decode_only_s": worker_metric("engine_decode_only_seconds_total"),
    "queued_tokens": worker_metric("queued_tokens"),
    "running": worker_metric("running"),
    "lora_waiting": worker_metric("lora_waiting_requests"),
    "lora_max": worker_metric("lora_max"),
}
DRAINING, UPTIME = worker_metric("draining").sample, worker_metric("uptime_s").sample
QUEUED = worker_metric("queued_tokens").sample
#: the prefill workers' per-request histograms -> the `Observation` field each fills
PREFILL_HISTOGRAMS = {
    worker_metric("prefill_request_tokens").name: "prefill_request_tokens",
    worker_metric("prefill_wait_seconds").name: "prefill_wait",
}


class MetricsError(RuntimeError):
    """The metrics could not be read."""


def parse_exposition(text: str) -> dict[Key, float]:
    """Every sample of a Prometheus text exposition, keyed by name and labels."""
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = float(sample.value)
    return out


def histogram_quantile(buckets: Mapping[float, float], q: float) -> float | None:
    """The ``q`` quantile of cumulative ``buckets`` (upper bound -> count), interpolated
    linearly within its bucket as Prometheus does; None without observations."""
    bounds = sorted(buckets)
    total = buckets[bounds[-1]] if bounds else 0.0
    if total <= 0:
        return None
    rank, lower, below = q * total, 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):
                return lower  # in the open top bucket: its lower edge is all we know
            width = count - below
            return lower + (upper - lower) * ((rank - below) / width if width > 0 else 1.0)
        lower, below = upper, count
    return lower


@dataclass(frozen=True)
class WorkerView:
    name: str
    role: str
    up: bool
    draining: bool
    age_s: float


def pool_states(
    workers: list[WorkerView], desired: Mapping[str, int | None]
) -> dict[str, PoolState]:
    """Ready/starting/draining per pool: ``starting`` is what the connector has asked
    for that is not up yet."""
    pools = {}
    for role in ROLES:
        mine = [w for w in workers if w.role == role and w.up]
        ready = sum(1 for w in mine if not w.draining)
        wanted = desired.get(role)
        starting = max(0, wanted - ready) if wanted is not None else 0
        pools[role] = PoolState(ready, starting, sum(1 for w in mine if w.draining))
    return pools


class GatewayMetrics:
    """Observations from differences of successive scrapes of the gateway's /metrics."""

    def __init__(self, gateway_url: str, timeout_s: float = 5.0) -> None:
        self.url = gateway_url.rstrip("/") + "/metrics"
        self._http = httpx.Client(timeout=timeout_s)
        self._last: tuple[float, dict[Key, float]] | None = None

    def close(self) -> None:
        self._http.close()

    def scrape(self) -> dict[Key, float]:
        try:
            resp = self._http.get(self.url)
            resp.raise_for_status()
        except httpx.HTTPError as exc:
            raise MetricsError(f"cannot scrape {self.url}: {exc}") from exc
        return parse_exposition(resp.text)

    def observe(self, desired: Mapping[str, int | None]) -> Observation | None:
        """The interval since the last call (None the first time: a baseline)."""
        now, samples = time.monotonic(), self.scrape()
        last, self._last = self._last, (now, samples)
        if last is None:
            return None
        return observation_between(last[1], samples, now - last[0], now, desired)


def _sample(
    name: str, role: str, age_s: float, interval_s: float, values: Mapping[str, float]
) -> WorkerSample:
    """A worker's `WorkerSample`: its counters' changes and gauges from ``values``, by
    field name (`SAMPLE_FIELDS`; 0 where absent; the counts as ints)."""
    fields: dict[str, float] = {}
    for f in dataclasses.fields(WorkerSample):
        if f.name in SAMPLE_FIELDS:
            value = values.get(f.name, 0.0)
            fields[f.name] = int(value) if isinstance(f.default, int) else value
    return WorkerSample(name, role, age_s, interval_s, **fields)  # type: ignore[arg-type]


def _delta(new: Mapping[Key, float], old: Mapping[Key, float], key: Key) -> float:
    return max(0.0, new.get(key, 0.0) - old.get(key, 0.0))


def _quantile_delta(new: Mapping[Key, float], old: Mapping[Key, float], name: str) -> float | None:
    buckets: dict[float, float] = {}
    for (sample, labels), value in new.items():
        if sample == f"{name}_bucket":
            le = float(dict(labels)["le"])
            buckets[le] = value - old.get((sample, labels), 0.0)
    return histogram_quantile(buckets, 0.9)


def _buckets(samples: Mapping[Key, float], name: str) -> dict[Labels, dict[float, float]]:
    """Histogram ``name``'s cumulative buckets per series (its labels without ``le``)."""
    out: dict[Labels, dict[float, float]] = {}
    for (sample, labels), value in samples.items():
        if sample == f"{name}_bucket":
            rest = dict(labels)
            le = float(rest.pop("le"))
            out.setdefault(tuple(sorted(rest.items())), {})[le] = value
    return out


def _histogram_delta(
    new: Mapping[float, float], old: Mapping[float, float] | None
) -> Histogram | None:
    old = old or {}
    return Histogram.from_cumulative({le: v - old.get(le, 0.0) for le, v in new.items()})


def _pool_histograms(
    new: Mapping[Key, float], old: Mapping[Key, float], prefill_workers: list[Labels]
) -> dict[str, Histogram | None]:
    """Each per-request histogram's change over the interval, summed over
    ``prefill_workers`` (label sets of workers up and not restarted); None where no
    worker exports it."""
    out: dict[str, Histogram | None] = {}
    for name, field_name in PREFILL_HISTOGRAMS.items():
        now, before = _buckets(new, name), _buckets(old, name)
        total = None
        for labels in prefill_workers:
            series = now.get(labels)
            if series is None:
                continue
            delta = _histogram_delta(series, before.get(labels))
            if delta is not None:
                total = delta if total is None else total + delta
        out[field_name] = total
    return out


def observation_between(
    old: Mapping[Key, float],
    new: Mapping[Key, float],
    interval_s: float,
    now_s: float,
    desired: Mapping[str, int | None],
) -> Observation:
    """What happened between two scrapes ``old`` and ``new``, ``interval_s`` apart."""
    dt = max(interval_s, 1e-6)
    requests = sum(_delta(new, old, k) for k in new if k[0] == "radixserve_requests_total")
    views, samples = [], []
    prefill_workers: list[Labels] = []  # up and not restarted: their histograms difference
    queue_growth, prefill_queue = 0.0, 0
    computed = generated = 0.0
    for key in [k for k in new if k[0] == WORKER_UP]:
        labels = dict(key[1])

        def gauge(sample: str, snap: Mapping[Key, float] = new, lab: Key = key) -> float:
            return snap.get((sample, lab[1]), 0.0)

        role, age = labels.get("role", ""), gauge(UPTIME)
        view = WorkerView(labels.get("worker", ""), role, gauge(WORKER_UP) > 0,
                          gauge(DRAINING) > 0, age)  # fmt: skip
        views.append(view)
        if not view.up or role not in ROLES:
            continue
        restarted = age < gauge(UPTIME, old) or (WORKER_UP, key[1]) not in old
        if role == "prefill":
            queued = int(gauge(QUEUED))
            prefill_queue += queued
            if not restarted:
                queue_growth += queued - gauge(QUEUED, old)
        if restarted:
            continue  # counters started over: no interval to difference
        if role == "prefill":
            prefill_workers.append(key[1])
        values = {f: _delta(new, old, (m.sample, key[1])) if m.kind == "counter"
                  else gauge(m.sample) for f, m in SAMPLE_FIELDS.items()}  # fmt: skip
        sample = _sample(view.name, role, age, dt, values)
        samples.append(sample)
        if role == "prefill":  # decode workers' own short prefills are not this pool's
            computed += sample.prefill_tokens
        generated += sample.decode_tokens
    return Observation(
        now_s=now_s,
        interval_s=dt,
        pools=pool_states(views, desired),
        requests_per_s=requests / dt,
        prefill_tokens_per_s=max(0.0, computed + queue_growth) / dt,
        output_tokens_per_s=generated / dt,
        ttft_p90_s=_quantile_delta(new, old, "radixserve_ttft_seconds"),
        itl_p90_s=_quantile_delta(new, old, "radixserve_itl_seconds"),
        prefill_queue_tokens=prefill_queue,
        workers=tuple(samples),
        **_pool_histograms(new, old, prefill_workers),  # type: ignore[arg-type]
    )


class PrometheusMetrics:
    """Observations from a Prometheus server's HTTP query API (``/api/v1/query``): rates
    and quantiles over ``window_s``, so a scrape interval of its own does not matter."""

    def __init__(self, url: str, window_s: float, timeout_s: float = 10.0) -> None:
        self.url = url.rstrip("/") + "/api/v1/query"
        self.window = f"{int(max(window_s, 1))}s"
        self._window_s = max(window_s, 1.0)
        self._http = httpx.Client(timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def query(self, promql: str) -> list[tuple[dict[str, str], float]]:
        """An instant query's vector: (labels, value) per series."""
        try:
            resp = self._http.get(self.url, params={"query": promql})
            resp.raise_for_status()
            body = resp.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise MetricsError(f"Prometheus query {promql!r} failed: {exc}") from exc
        if body.get("status") != "success" or body["data"]["resultType"] != "vector":
            raise MetricsError(f"Prometheus query {promql!r}: {body.get('error', body)}")
        return [(s["metric"], float(s["value"][1])) for s in body["data"]["result"]]

    def _scalar(self, promql: str) -> float | None:
        rows = self.query(promql)
        return rows[0][1] if rows and not math.isnan(rows[0][1]) else None  # NaN: no data

    def observe(self, desired: Mapping[str, int | None]) -> Observation:
        w = self.window
        per_worker: dict[tuple[str, str], dict[str, float]] = {}
        queries = {"up": WORKER_UP, "draining": DRAINING, "uptime_s": UPTIME}
        for f, m in SAMPLE_FIELDS.items():
            queries[f] = f"increase({m.sample}[{w}])" if m.kind == "counter" else m.sample
        for field, promql in queries.items():
            for labels, value in self.query(promql):
                key = (labels.get("worker", ""), labels.get("role", ""))
                per_worker.setdefault(key, {})[field] = value
        views, samples = [], []
        for (name, role), v in per_worker.items():
            view = WorkerView(name, role, v.get("up", 0) > 0, v.get("draining", 0) > 0,
                              v.get("uptime_s", 0.0))  # fmt: skip
            views.append(view)
            if view.up and role in ROLES:
                samples.append(_sample(name, role, view.age_s, self._window_s, v))
        growth = self._scalar(f'sum(deriv({QUEUED}{{role="prefill"}}[{w}]))')
        computed = sum(s.prefill_tokens for s in samples if s.role == "prefill")
        quantile = "histogram_quantile(0.9, sum by (le) (rate({}_bucket[{}])))"
        histograms = {
            field_name: self._histogram(name) for name, field_name in PREFILL_HISTOGRAMS.items()
        }
        return Observation(
            now_s=time.monotonic(),
            interval_s=self._window_s,
            pools=pool_states(views, desired),
            requests_per_s=self._scalar(f"sum(rate(radixserve_requests_total[{w}]))") or 0.0,
            prefill_tokens_per_s=max(0.0, computed / self._window_s + (growth or 0.0)),
            output_tokens_per_s=sum(s.decode_tokens for s in samples) / self._window_s,
            ttft_p90_s=self._scalar(quantile.format("radixserve_ttft_seconds", w)),
            itl_p90_s=self._scalar(quantile.format("radixserve_itl_seconds", w)),
            prefill_queue_tokens=int(sum(s.queued_tokens for s in samples if s.role == "prefill")),
            workers=tuple(samples),
            **histograms,  # type: ignore[arg-type]
        )

    def _histogram(self, name: str) -> Histogram | None:
        """A prefill pool histogram's increase over the window (None: not exported)."""
        promql = f'sum by (le) (increase({name}_bucket{{role="prefill"}}[{self.window}]))'
        buckets = {float(labels["le"]): value for labels, value in self.query(promql)
                   if "le" in labels and not math.isnan(value)}  # fmt: skip
        return Histogram.from_cumulative(buckets)
