"""The workers' families from their typed heartbeats: one table (`WORKER_METRICS`) names
every number as before (``radixserve_worker_<field>``, a counter's ``_total`` in its
sample), the gateway renders a cluster's workers from it (absent sections and fields
exported as nothing), /debug/cache flattens them as before, and the autoscaler reads
back, by the same rows, what the gateway rendered."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from radixserve.metrics import PREFILL_WAIT_BUCKETS, ServingMetrics, StatsHistogram
from radixserve.protocol.link_messages import WorkerLoad
from radixserve.protocol.stats_messages import (
    DecodeSection,
    DiskPoolSection,
    EngineSection,
    HostPoolSection,
    HostTierSection,
    KVStoreSection,
    PrefillSection,
    ServiceStats,
)
from radixserve.services.autoscaler.metrics_source import SAMPLE_FIELDS
from radixserve.worker_metrics import WORKER_METRICS, WorkerView, service_metrics, worker_metric


def cluster_views() -> dict[str, WorkerView]:
    """A decode worker (audit on, a host tier), a prefill worker that served two
    requests, the kvstore with both tiers, and a prefill worker that is down."""
    waits = StatsHistogram(PREFILL_WAIT_BUCKETS)
    for wait in (0.004, 3.0):
        waits.observe(wait)
    engine = EngineSection(
        pages_total=100, pages_used=40, pages_free=60, pages_cached=30, pages_locked=4,
        pages_evictable=26, page_bytes=4096, live_requests=2, audit_checked=10,
        audit_mismatches=1, audit_skipped=2, audit_pending=0, audit_fail_closed=0,
        engine_prefill_tokens_total=900, engine_busy_seconds_total=1.5,
        speculative_prompt_steps_total=10, speculative_prompt_drafted_total=40,
        speculative_prompt_accepted_total=30, speculative_prompt_emitted_total=40,
    )  # fmt: skip
    decode = ServiceStats(
        uptime_s=60.0, heartbeats_total=12, engine=engine,
        host_tier=HostTierSection(host_attach_settled=1, kv_identity_mismatch_total=2),
        decode=DecodeSection(kv_transfers_total=3, kv_transfer_seconds_total=0.5),
    )  # fmt: skip
    prefill = ServiceStats(
        uptime_s=30.0, engine=EngineSection(pages_total=50, engine_prefill_tokens_total=700),
        prefill=PrefillSection(prefill_requests_total=2, prefill_wait_seconds=waits.stats()),
    )  # fmt: skip
    kvstore = ServiceStats(kvstore=KVStoreSection(
        members=3, kv_identity_mismatch_total=4,
        host=HostPoolSection(host_pages_total=64, host_pages_used=8, host_pages_free=56,
                             host_pages_stored=8, host_pages_leased=1),
        disk=DiskPoolSection(disk_pages_total=1000, disk_pages_used=10, disk_pages_free=990,
                             disk_pages_stored=10, disk_tier_ready=1),
    ))  # fmt: skip
    return {
        "decode-0": WorkerView(
            "decode", True, "tcp://d:1", 5, False, 2, None, WorkerLoad(5, 2, 1), decode, 1, 7
        ),  # fmt: skip
        "prefill-0": WorkerView(
            "prefill", True, "tcp://p:1", 6, False, 1, None, WorkerLoad(300, 1, 0), prefill
        ),  # fmt: skip
        "kvstore": WorkerView(
            "kvstore", True, "tcp://k:1", 7, False, 0, None, WorkerLoad(), kvstore
        ),  # fmt: skip
        "prefill-1": WorkerView("prefill", False, "tcp://p:2", -1, True, 1),
    }


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(text) for s in f.samples}  # fmt: skip


def at(worker: str, role: str, **more: str) -> tuple[tuple[str, str], ...]:
    return tuple(sorted({"worker": worker, "role": role, **more}.items()))


def test_the_table_keeps_the_names_of_the_numbers() -> None:
    names = {row.path[-1]: row.sample for row in WORKER_METRICS}
    assert names["pages_used"] == "radixserve_worker_pages_used"
    assert names["pages_total"] == "radixserve_worker_pages_total"
    assert names["engine_prefill_tokens_total"] == "radixserve_worker_engine_prefill_tokens_total"
    assert names["uptime_s"] == "radixserve_worker_uptime_s"
    assert names["queued_tokens"] == "radixserve_worker_queued_tokens"
    assert names["prefill_wait_seconds"] == "radixserve_worker_prefill_wait_seconds"
    assert names["kv_identity_mismatch_total"] == "radixserve_kv_identity_mismatch_total"
    for row in WORKER_METRICS:  # a counter is named *_total (a gauge may be: pages_total)
        assert row.kind != "counter" or row.path[-1].endswith("_total") or not row.exported, row
        assert row.help and row.name.startswith("radixserve_"), row
    # one row per number: a family's name is one field's (the identity mismatches of
    # the worker's host tier and of the kvstore are one family)
    by_name: dict[str, set[str]] = {}
    for row in WORKER_METRICS:
        by_name.setdefault(row.name, set()).add(row.path[-1])
    assert all(len(fields) == 1 for fields in by_name.values()), by_name


def test_the_gateway_renders_each_workers_numbers_and_nothing_absent() -> None:
    got = samples(ServingMetrics().render({}, cluster_views()).decode())
    d0, p0, kv = at("decode-0", "decode"), at("prefill-0", "prefill"), at("kvstore", "kvstore")
    assert got[("radixserve_worker_pages_used", d0)] == 40
    assert got[("radixserve_worker_running", d0)] == 2
    assert got[("radixserve_worker_heartbeats_total", d0)] == 12
    assert got[("radixserve_worker_gateway_in_flight", d0)] == 1
    assert got[("radixserve_worker_tp_size", d0)] == 2
    assert got[("radixserve_worker_host_attach_settled", d0)] == 1
    assert got[("radixserve_kv_transfer_seconds_count", d0)] == 3
    assert got[("radixserve_kv_transfer_seconds_sum", d0)] == 0.5
    assert got[("radixserve_cache_audit_total", at("decode-0", "decode", result="match"))] == 9
    assert got[("radixserve_worker_audit_fail_closed", d0)] == 0
    assert got[("radixserve_kv_identity_mismatch_total", d0)] == 2
    assert got[("radixserve_kv_identity_mismatch_total", kv)] == 4
    assert got[("radixserve_worker_host_pages_total", kv)] == 64
    assert got[("radixserve_worker_disk_tier_ready", kv)] == 1
    assert got[("radixserve_worker_prefill_wait_seconds_bucket", at(
        "prefill-0", "prefill", le="0.005"))] == 1  # fmt: skip
    assert got[("radixserve_worker_prefill_wait_seconds_count", p0)] == 2
    assert got[("radixserve_worker_prefill_wait_seconds_sum", p0)] == 3.004
    assert got[("radixserve_worker_up", at("prefill-1", "prefill"))] == 0
    # the audit's counts are read into its results, not exported on their own
    assert not any(name.startswith("radixserve_worker_audit_checked") for name, _ in got)
    # absent: no prefix cache on prefill-0, no engine on the kvstore, nothing from a
    # worker that is down but its link's numbers
    assert ("radixserve_worker_pages_cached", d0) in got
    assert ("radixserve_worker_pages_cached", p0) not in got
    assert ("radixserve_worker_pages_total", kv) not in got
    down = {name for name, labels in got if labels == at("prefill-1", "prefill")}
    assert down == {"radixserve_worker_up", "radixserve_worker_discovered",
                    "radixserve_worker_tp_size"}  # fmt: skip


def test_a_service_exports_its_own_numbers_by_the_same_table() -> None:
    view = cluster_views()["decode-0"]
    assert view.load is not None and view.stats is not None
    own = samples(service_metrics("decode-0", "decode", view.load, view.stats).decode())
    gateway = samples(ServingMetrics().render({}, {"decode-0": view}).decode())
    link_only = {"radixserve_worker_discovered", "radixserve_worker_tp_size",
                 "radixserve_worker_gateway_in_flight", "radixserve_worker_routing_view_pages"}  # fmt: skip
    workers = {k: v for k, v in gateway.items() if dict(k[1]).get("worker") == "decode-0"}
    assert own == {k: v for k, v in workers.items() if k[0] not in link_only}


def test_debug_cache_flattens_each_worker_by_field_name() -> None:
    views = cluster_views()
    decode = views["decode-0"].as_dict()
    assert decode["pages_used"] == 40 and decode["running"] == 2
    assert decode["draining"] is False and decode["gateway_in_flight"] == 1
    assert decode["routing_view_pages"] == 7 and decode["kv_transfers_total"] == 3
    assert decode["address"] == "tcp://d:1" and decode["generation"] == 5
    assert "pages_cached" in decode and "members" not in decode
    prefill = views["prefill-0"].as_dict()
    assert prefill["prefill_wait_seconds:le=0.005"] == 1
    assert prefill["prefill_wait_seconds:le=+Inf"] == 2
    assert prefill["prefill_wait_seconds:sum"] == 3.004
    assert "pages_cached" not in prefill
    assert views["kvstore"].as_dict()["host_pages_total"] == 64
    assert views["prefill-1"].as_dict() == {
        "role": "prefill", "address": "tcp://p:2", "up": False, "generation": -1,
        "discovered": True, "tp_size": 1, "model_identity": None,
    }  # fmt: skip


def test_the_autoscaler_reads_back_what_the_gateway_rendered() -> None:
    views = cluster_views()
    got = samples(ServingMetrics().render({}, views).decode())
    for name, view in views.items():
        if not view.up:
            continue
        for field, row in SAMPLE_FIELDS.items():
            value = row.value(view)
            if value is not None:
                assert got[(row.sample, at(name, view.role))] == value, field
    assert worker_metric("engine_prefill_tokens_total").value(views["prefill-0"]) == 700
    restarted = dataclasses.replace(views["prefill-0"], stats=None)
    assert worker_metric("engine_prefill_tokens_total").value(restarted) is None


def test_every_number_an_engine_keeps_has_its_field() -> None:
    """A worker sends its engine's pool, audit and step numbers by field name (`fill`,
    which leaves out names that are not fields): a number added to the engine without
    a field would never be sent."""
    from radixserve.engine.info import EngineStats
    from tests.engine.engine_helpers import TINY, make_engine

    engine = make_engine(TINY, kv_cache_memory_gib=0.02, audit_sample_rate=1.0)
    stats = EngineStats.of(engine)
    fields = {f.name for f in dataclasses.fields(EngineSection)}
    assert "audit_checked" in stats.cache and "lora_loads_total" in stats.lora
    assert set(stats.cache) | set(stats.steps) | set(stats.lora) <= fields


def test_a_workers_lora_slot_counters_move_and_are_exported(tmp_path: Path) -> None:
    """One adapter slot (max_loras 1) and requests of two adapters queued together: while
    the first adapter's run, the other's request waits for the slot (counted); then it is
    copied in and the first evicted: two loads, one eviction, one adapter resident of one
    slot, in the engine's stats and in a decode worker's own /metrics as
    ``radixserve_worker_lora_*``."""
    pytest.importorskip("peft")
    from radixserve.engine.async_engine import AsyncEngine
    from radixserve.engine.engine import Engine
    from radixserve.engine.info import EngineStats
    from radixserve.engine.sampling_params import SamplingParams
    from radixserve.runtime.adapters import adapter_infos
    from radixserve.services.decode.settings import DecodeSettings
    from radixserve.services.decode.worker import DecodeWorker
    from radixserve.settings import EngineSettings
    from tests.engine.engine_helpers import write_tiny_model
    from tests.gateway.lora_helpers import write_adapters

    model = write_tiny_model(tmp_path / "model")
    dirs = write_adapters(model, tmp_path / "adapters", ("qv", "all"))
    engine = Engine(EngineSettings(
        model=str(model), device="cpu", load_progress=False, kv_cache_memory_gib=0.02,
        prefix_cache=False, max_loras=1, lora_modules=tuple(f"{n}={p}" for n, p in dirs.items()),
    ))  # fmt: skip
    params = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0)
    for i, adapter in enumerate(("qv", "qv", "all")):
        engine.add_request([40 + i] * 9, params, adapter=adapter)
    engine.step()
    slots = {"lora_resident": 1, "lora_max": 1, "lora_loads_total": 1, "lora_evictions_total": 0}
    assert EngineStats.of(engine).lora == {**slots, "lora_waiting_requests": 1}
    while engine.has_unfinished():
        engine.step()
    slots.update(lora_loads_total=2, lora_evictions_total=1)
    assert EngineStats.of(engine).lora == {**slots, "lora_waiting_requests": 0}
    served = AsyncEngine(engine)
    try:
        worker = DecodeWorker(DecodeSettings(name="decode-0", transfer_backend="zmq"), served)
        worker.loras.adopt(adapter_infos(engine))  # as at its start
        got = samples(worker.metrics_text().decode())
    finally:
        served.close()
    d0 = at("decode-0", "decode")
    assert {name: got[(f"radixserve_worker_{name}", d0)] for name in slots} == slots
    assert got[("radixserve_worker_lora_waiting_requests", d0)] == 0
    # and by adapter: "qv" copied in and evicted once, "all" copied in once
    per_adapter = {(a, what): got[(f"radixserve_worker_lora_adapter_{what}_total",
                                   at("decode-0", "decode", adapter=a))]
                   for a in ("qv", "all") for what in ("loads", "evictions")}  # fmt: skip
    assert per_adapter == {("qv", "loads"): 1, ("qv", "evictions"): 1,
                           ("all", "loads"): 1, ("all", "evictions"): 0}  # fmt: skip
