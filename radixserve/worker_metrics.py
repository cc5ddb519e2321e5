"""The workers' Prometheus families: one table, from the typed heartbeat.

`WORKER_METRICS` has a row per number a worker's series is made of: the gateway's
view of its link (`WorkerView`), its load (`WorkerLoad`) and its stats
(`ServiceStats`), each field's name, kind and help from the field itself
(`radixserve.protocol.stats_messages.MetricSpec`). The gateway renders its workers'
families from it (`worker_families`), each service its own (`service_metrics`), and the
autoscaler reads them back by the same rows (`services.autoscaler.metrics_source`).

Names: ``radixserve_worker_<field>`` (a counter's ``_total`` is the exposition's), with
labels ``worker`` and ``role``; besides the rows, ``radixserve_worker_up``,
``radixserve_kv_transfer_seconds`` (a summary: a decode worker's transfers and their
seconds) and ``radixserve_cache_audit{result}`` (an engine's audit: match, mismatch,
skipped).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from radixserve.protocol.link_messages import WorkerLoad
from radixserve.protocol.stats_messages import (
    EngineSection,
    HistogramStats,
    MetricKind,
    MetricSpec,
    ServiceStats,
)
from radixserve.protocol.wire import NestedSpec, OptionalSpec

_PREFIX = "radixserve_worker_"
WORKER_UP = f"{_PREFIX}up"  # 1 while the worker is up (the gateway's view of its link)


def _view_field(kind: MetricKind, help: str) -> Any:
    return dataclasses.field(default=None, metadata={"metric": MetricSpec(kind, help)})


class Snapshot(Collector):
    """Exports families made at scrape time from ``snapshot`` (set before each scrape)."""

    def __init__(self, families: Callable[[Any], Iterator[Any]], snapshot: Any = None) -> None:
        self.snapshot: Any = snapshot if snapshot is not None else {}
        self._families = families

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        return self._families(self.snapshot)


@dataclass(frozen=True)
class WorkerView:
    """A worker as the gateway sees it: its link (``discovered`` from the membership,
    its ``tp_size``, and for a decode worker the gateway's requests on it and the pages
    its routing view holds), its latest load and stats (None while down, or before its
    first heartbeat)."""

    role: str
    up: bool
    address: str = ""
    generation: int = 0
    discovered: bool | None = _view_field("gauge", "1 when found through the membership.")
    tp_size: int | None = _view_field("gauge", "Ranks the worker's pool is split over.")
    model_identity: dict[str, Any] | None = None
    load: WorkerLoad | None = dataclasses.field(default=None, metadata={"section": WorkerLoad})
    stats: ServiceStats | None = dataclasses.field(default=None, metadata={"section": ServiceStats})
    gateway_in_flight: int | None = _view_field("gauge", "The gateway's requests on the worker.")
    routing_view_pages: int | None = _view_field("gauge", "Pages in the gateway's routing view.")

    def as_dict(self) -> dict[str, Any]:
        """The flat map /debug/cache shows: the link, then each stats and load field by
        its name (a histogram as ``<name>:le=<bound>`` and ``<name>:sum``)."""
        out: dict[str, Any] = {"role": self.role, "address": self.address, "up": self.up,
                               "generation": self.generation, "discovered": self.discovered,
                               "tp_size": self.tp_size, "model_identity": self.model_identity}  # fmt: skip
        for row in WORKER_METRICS:
            value = row.value(self)
            if row.path[0] in ("stats", "load") and value is not None:
                out.update(_flat(row.path[-1], value))
        if self.stats is not None and self.stats.loras:  # its LoRA adapters' contents
            out["loras"] = {info.name: info.fingerprint for info in self.stats.loras}
        for key in ("gateway_in_flight", "routing_view_pages"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _flat(name: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, HistogramStats):
        return {name: value}
    bounds = [*map(floatToGoString, value.bounds), "+Inf"]
    out: dict[str, Any] = {f"{name}:le={b}": c for b, c in zip(bounds, value.counts, strict=True)}
    out[f"{name}:sum"] = value.sum
    return out


@dataclass(frozen=True)
class WorkerMetric:
    """One row: the attribute ``path`` from a `WorkerView` to a number, and its family."""

    path: tuple[str, ...]
    name: str
    kind: str
    help: str
    exported: bool = True

    @property
    def sample(self) -> str:
        """The sample name it is read back by (a counter's with ``_total``)."""
        return f"{self.name}_total" if self.kind == "counter" else self.name

    def value(self, view: object) -> Any:
        """The number in ``view`` (None: not there)."""
        for attr in self.path:
            view = getattr(view, attr, None)
            if view is None:
                return None
        return view


def _section_of(f: dataclasses.Field[Any]) -> type | None:
    cls = f.metadata.get("section")
    spec = f.metadata.get("wire")
    spec = spec.inner if isinstance(spec, OptionalSpec) else spec
    if cls is None and isinstance(spec, NestedSpec) and "metric" not in f.metadata:
        cls = spec.cls
    return cls


def _rows(cls: type, path: tuple[str, ...] = ()) -> Iterator[WorkerMetric]:
    for f in dataclasses.fields(cls):
        spec: MetricSpec | None = f.metadata.get("metric")
        section = _section_of(f)
        if spec is not None:
            base = f.name.removesuffix("_total") if spec.kind == "counter" else f.name
            name = spec.name or f"{_PREFIX}{base}"
            yield WorkerMetric((*path, f.name), name, spec.kind, spec.help, spec.exported)
        elif section is not None:
            yield from _rows(section, (*path, f.name))


#: every number of a worker's series, in the order of the structs' fields
WORKER_METRICS: tuple[WorkerMetric, ...] = tuple(_rows(WorkerView))
_BY_FIELD: dict[str, WorkerMetric] = {}
for _row in WORKER_METRICS:
    _BY_FIELD.setdefault(_row.path[-1], _row)


def worker_metric(field_name: str) -> WorkerMetric:
    """The row of the field named ``field_name`` (the first, where sections share one)."""
    return _BY_FIELD[field_name]


_LABELS = ["worker", "role"]
AUDIT_DOC = "Cache hits recomputed without the cache, by result (match, mismatch, skipped)."


def audit_results(checked: float, mismatches: float, skipped: float) -> list[tuple[str, float]]:
    """(result, count) of a cache audit; matches are the audits checked that matched."""
    return [("match", checked - mismatches), ("mismatch", mismatches), ("skipped", skipped)]


def _engine_audit(engine: EngineSection | None) -> list[tuple[str, float]]:
    if engine is None or engine.audit_checked is None:
        return []
    return audit_results(engine.audit_checked, engine.audit_mismatches or 0,
                         engine.audit_skipped or 0)  # fmt: skip


def _family(row: WorkerMetric) -> Any:
    if row.kind == "counter":
        return CounterMetricFamily(row.name, row.help, labels=_LABELS)
    if row.kind == "histogram":
        return HistogramMetricFamily(row.name, row.help, labels=_LABELS)
    return GaugeMetricFamily(row.name, row.help, labels=_LABELS)


def worker_families(snapshot: Mapping[str, WorkerView]) -> Iterator[Any]:
    """The workers' latest numbers (name -> view) as labelled families."""
    up = GaugeMetricFamily(WORKER_UP, "1 while the worker is up.", labels=_LABELS)
    transfer = SummaryMetricFamily(
        "radixserve_kv_transfer_seconds", "KV page transfers into the worker.", labels=_LABELS
    )
    audit = CounterMetricFamily("radixserve_cache_audit", AUDIT_DOC, labels=[*_LABELS, "result"])
    lora_loads = CounterMetricFamily(
        "radixserve_worker_lora_adapter_loads", "Copies of a LoRA adapter into a device slot, "
        "by adapter.", labels=[*_LABELS, "adapter"])  # fmt: skip
    lora_evictions = CounterMetricFamily(
        "radixserve_worker_lora_adapter_evictions", "Evictions of a LoRA adapter from its "
        "device slot (its host copy kept), by adapter.", labels=[*_LABELS, "adapter"])  # fmt: skip
    families: dict[str, Any] = {}
    for name, view in sorted(snapshot.items()):
        ids = [name, view.role]
        up.add_metric(ids, 1.0 if view.up else 0.0)
        stats = view.stats
        for info in stats.loras if stats is not None else ():
            lora_loads.add_metric([*ids, info.name], info.loads)
            lora_evictions.add_metric([*ids, info.name], info.evictions)
        decode = stats.decode if stats is not None else None
        if decode is not None:
            transfer.add_metric(ids, decode.kv_transfers_total, decode.kv_transfer_seconds_total)
        for result, count in _engine_audit(stats.engine if stats is not None else None):
            audit.add_metric([*ids, result], count)
        for row in WORKER_METRICS:
            value = row.value(view)
            if value is None or not row.exported:
                continue
            family = families.get(row.name) or _family(row)
            families[row.name] = family
            if isinstance(value, HistogramStats):
                bounds = [*map(floatToGoString, value.bounds), "+Inf"]
                points = [(b, float(c)) for b, c in zip(bounds, value.counts, strict=True)]
                family.add_metric(ids, points, value.sum)
            else:
                family.add_metric(ids, float(value))
    yield up
    yield transfer
    if audit.samples:
        yield audit
    if lora_loads.samples:
        yield lora_loads
        yield lora_evictions
    yield from families.values()


def service_metrics(name: str, role: str, load: WorkerLoad, stats: ServiceStats) -> bytes:
    """One service's own families (its heartbeat's ``load`` and ``stats``), labelled
    ``worker=name, role=role``, as the Prometheus text exposition."""
    registry = CollectorRegistry(auto_describe=True)
    registry.register(
        Snapshot(worker_families, {name: WorkerView(role, True, load=load, stats=stats)})
    )
    return generate_latest(registry)
