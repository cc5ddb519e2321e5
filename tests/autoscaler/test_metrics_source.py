"""Observations from metrics: two real /metrics expositions of the gateway's own
`ServingMetrics` a few seconds apart become one `Observation` (p90s from the histogram
buckets' change, rates, per-worker counter samples, the prefill workers' per-request
histograms summed over the pool, pools); a restarted worker's counters are not
differenced; and the Prometheus source asks the query API for the same series."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

import pytest

from radixserve.metrics import (
    PREFILL_TOKENS_BUCKETS,
    PREFILL_WAIT_BUCKETS,
    ServingMetrics,
    StatsHistogram,
)
from radixserve.protocol.cached_tokens import CachedTokens
from radixserve.protocol.link_messages import WorkerLoad
from radixserve.protocol.stats_messages import EngineSection, PrefillSection, ServiceStats
from radixserve.services.autoscaler.metrics_source import (
    PrometheusMetrics,
    histogram_quantile,
    observation_between,
    parse_exposition,
)
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings
from radixserve.worker_metrics import WorkerView


def worker(
    role: str,
    uptime: float,
    served: list[tuple[int, float]] | None = None,
    draining: bool = False,
    **counters: float,
) -> WorkerView:
    """A worker as the gateway sees it: up ``uptime`` seconds, its engine's step
    counters (``prefill_tokens=`` for ``engine_prefill_tokens_total`` ...) and, for a
    prefill worker, the requests it ``served``."""
    load = WorkerLoad(int(counters.pop("queued", 0)), int(counters.pop("running", 0)),
                      draining=draining)  # fmt: skip
    engine = EngineSection(**{f"engine_{k}_total": v for k, v in counters.items()})  # type: ignore[arg-type]
    prefill = requests(*served) if served is not None else None
    stats = ServiceStats(uptime_s=uptime, engine=engine, prefill=prefill)
    return WorkerView(role, True, load=load, stats=stats)


def requests(*served: tuple[int, float]) -> PrefillSection:
    """A prefill worker's per-request histograms (as its heartbeat carries them) after
    serving ``served`` (uncached tokens, wait) requests."""
    tokens = StatsHistogram(PREFILL_TOKENS_BUCKETS)
    waits = StatsHistogram(PREFILL_WAIT_BUCKETS)
    for n, wait in served:
        tokens.observe(n)
        waits.observe(wait)
    return PrefillSection(prefill_wait_seconds=waits.stats(),
                          prefill_request_tokens=tokens.stats())  # fmt: skip


def test_two_scrapes_become_one_observation():
    m = ServingMetrics()
    early = [(2000, 0.0)] * 5
    late = early + [(40000, 0.0)] * 2 + [(1000, 2.0)] * 8  # this interval: 10 requests
    before = m.render({}, {
        "prefill-0": worker("prefill", 100, early, prefill_tokens=1000, prefill_seconds=1.0,
                            busy_seconds=1.0, queued=500),
        "prefill-1": worker("prefill", 300, late),
        "decode-0": worker("decode", 100, decode_only_steps=100, decode_only_seqs=800,
                           decode_only_seconds=2.0, decode_tokens=800, busy_seconds=2.0),
        "decode-1": worker("decode", 900),
    }).decode()  # fmt: skip
    for ttft in [0.1] * 8 + [3.0, 3.0]:  # p90 lands in the top bucket reached: 2.5..5 s
        m.ttft.observe(ttft)
    for _ in range(10):
        m.itl.observe(0.02)
    for _ in range(10):
        m.record_finish(100, CachedTokens(device=50), 10, "stop")
    after = m.render({}, {
        "prefill-0": worker("prefill", 110, late, prefill_tokens=81000, prefill_seconds=11.0,
                            busy_seconds=11.0, queued=2500),
        "prefill-1": worker("prefill", 4, [(500, 0.0)]),  # restarted
        "decode-0": worker("decode", 110, decode_only_steps=600, decode_only_seqs=8800,
                           decode_only_seconds=12.0, decode_tokens=8800, busy_seconds=12.0,
                           running=16),
        "decode-1": worker("decode", 5, decode_only_steps=50),  # restarted meanwhile
        "decode-2": worker("decode", 400, draining=True),
    }).decode()  # fmt: skip
    obs = observation_between(parse_exposition(before), parse_exposition(after), 10.0, 50.0,
                              {"prefill": 3, "decode": None})  # fmt: skip
    assert "prefill-1" not in {s.name for s in obs.workers}
    assert obs.requests_per_s == 1.0
    assert 2.5 <= obs.ttft_p90_s <= 5.0
    assert 0.01 <= obs.itl_p90_s <= 0.025
    # prefill demand: 80k computed + a queue grown by 2,000 over 10 s
    assert obs.prefill_tokens_per_s == pytest.approx(8200.0)
    assert obs.output_tokens_per_s == pytest.approx(800.0)
    assert obs.prefill_queue_tokens == 2500
    assert obs.pools["prefill"].ready == 2 and obs.pools["prefill"].starting == 1
    # the interval's requests at prefill-0 (prefill-1 restarted: not differenced)
    tokens, waits = obs.prefill_request_tokens, obs.prefill_wait
    assert tokens is not None and waits is not None
    assert tokens.total == 10 and tokens.count_above(30000) == 2
    assert waits.total == 10 and 1.0 <= waits.quantile(0.9) <= 2.5
    assert (obs.pools["decode"].ready, obs.pools["decode"].draining) == (2, 1)
    samples = {s.name: s for s in obs.workers}
    assert "decode-1" not in samples  # restarted: nothing to difference
    assert samples["prefill-0"].prefill_tokens == 80000 and samples["prefill-0"].prefill_s == 10.0
    d = samples["decode-0"]
    assert (d.decode_only_steps, d.decode_only_seqs, d.decode_only_s) == (500, 8000, 10.0)
    assert d.running == 16 and d.age_s == 110


def test_requests_waiting_for_a_lora_slot_are_read_per_worker_and_scale_the_pool():
    """The workers' ``lora_waiting_requests`` and ``lora_max`` gauges, as the gateway
    renders them, reach each worker's sample (a gauge: its value now, not a change), and
    the policy given that observation adds a decode replica for them."""
    m = ServingMetrics()

    def slots(waiting: int) -> dict[str, WorkerView]:
        views = {}
        for name, wait in (("decode-0", waiting), ("decode-1", 0)):
            engine = EngineSection(lora_max=2, lora_resident=2, lora_waiting_requests=wait)
            stats = ServiceStats(uptime_s=100, engine=engine)
            views[name] = WorkerView("decode", True, load=WorkerLoad(), stats=stats)
        return views

    before = parse_exposition(m.render({}, slots(9)).decode())
    after = parse_exposition(m.render({}, slots(3)).decode())
    obs = observation_between(before, after, 10.0, 10.0, {"prefill": None, "decode": None})
    got = {s.name: (s.lora_waiting, s.lora_max) for s in obs.workers}
    assert got == {"decode-0": (3, 2), "decode-1": (0, 2)}
    settings = AutoscalerSettings(min_prefill=0, min_decode=1, max_decode=4)
    decode = ScalingPolicy(settings).decide(obs)[1]
    assert (decode.current, decode.desired, decode.kind) == (2, 3, "lora_slots")
    after = parse_exposition(m.render({}, slots(0)).decode())
    obs = observation_between(before, after, 10.0, 10.0, {"prefill": None, "decode": None})
    assert ScalingPolicy(settings).decide(obs)[1].kind != "lora_slots"


def test_histogram_quantile_interpolates_like_prometheus():
    inf = float("inf")
    assert histogram_quantile({0.1: 0, 0.5: 0, inf: 0}, 0.9) is None
    assert histogram_quantile({1.0: 10.0, 2.0: 20.0, inf: 20.0}, 0.5) == 1.0
    assert histogram_quantile({1.0: 0.0, 2.0: 10.0, inf: 10.0}, 0.9) == pytest.approx(1.9)
    assert histogram_quantile({1.0: 0.0, inf: 10.0}, 0.9) == 1.0  # open top bucket


class _FakePrometheus(BaseHTTPRequestHandler):
    """Answers /api/v1/query as Prometheus does. No Prometheus server can be installed
    from PyPI (CI has nothing else), so this stands in for one; what is checked is that
    the source asks for the right series and reads the API's answer shape."""

    queries: list[str] = []

    def do_GET(self):  # noqa: N802
        query = parse_qs(urlparse(self.path).query)["query"][0]
        self.queries.append(query)
        result = []
        if query.startswith("histogram_quantile") and "ttft" in query:
            result = [{"metric": {}, "value": [0, "1.5"]}]
        elif query.startswith("histogram_quantile"):
            result = [{"metric": {}, "value": [0, "NaN"]}]  # no ITL samples in the window
        elif query == "radixserve_worker_up":
            result = [{"metric": {"worker": "prefill-0", "role": "prefill"}, "value": [0, "1"]}]
        elif query == "radixserve_worker_lora_waiting_requests":
            result = [{"metric": {"worker": "prefill-0", "role": "prefill"}, "value": [0, "2"]}]
        elif query == "radixserve_worker_uptime_s":
            result = [{"metric": {"worker": "prefill-0", "role": "prefill"}, "value": [0, "99"]}]
        elif "engine_prefill_tokens" in query:
            result = [{"metric": {"worker": "prefill-0", "role": "prefill"},
                       "value": [0, "120000"]}]  # fmt: skip
        elif query.startswith("sum(rate(radixserve_requests_total"):
            result = [{"metric": {}, "value": [0, "2.5"]}]
        elif "prefill_request_tokens_bucket" in query:  # 3 requests: 2 of 1k, 1 of 40k
            result = [{"metric": {"le": le}, "value": [0, n]}
                      for le, n in (("1024.0", "2"), ("46341.0", "3"), ("+Inf", "3"))]  # fmt: skip
        body = json.dumps({"status": "success", "data": {"resultType": "vector",
                                                          "result": result}}).encode()  # fmt: skip
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_prometheus_source_reads_the_query_api():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakePrometheus)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        source = PrometheusMetrics(f"http://127.0.0.1:{server.server_address[1]}", 60.0)
        obs = source.observe({"prefill": 1, "decode": None})
        source.close()
    finally:
        server.shutdown()
        server.server_close()
    assert obs.ttft_p90_s == 1.5 and obs.itl_p90_s is None
    assert obs.prefill_request_tokens is not None and obs.prefill_request_tokens.total == 3
    assert obs.prefill_wait is None  # not exported: no split, as without per-request numbers
    assert obs.requests_per_s == 2.5
    assert obs.pools["prefill"].ready == 1
    [sample] = obs.workers
    assert sample.name == "prefill-0" and sample.prefill_tokens == 120000 and sample.age_s == 99
    assert sample.lora_waiting == 2  # a gauge, queried as its value
    assert obs.prefill_tokens_per_s == pytest.approx(2000.0)  # 120k over the 60 s window
    assert any("increase(radixserve_worker_engine_prefill_tokens_total[60s])" in q
               for q in _FakePrometheus.queries)  # fmt: skip
    assert ('sum by (le) (increase(radixserve_worker_prefill_wait_seconds_bucket{role="prefill"}'
            "[60s]))") in _FakePrometheus.queries  # fmt: skip
