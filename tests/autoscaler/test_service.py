"""The control loop's report of infeasible requests: a prompt longer than a replica
computes within the TTFT target is logged and counted in the autoscaler's /metrics, the
remedies are advised, and no replica is added (dry-run connector).

The gateway's /metrics are real expositions of its `ServingMetrics`, parsed and
differenced by the live code (`observation_between`); only the ten seconds between two
scrapes are not waited for (`_Scrapes` hands them over at a fixed interval)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from radixserve.bench.local_cluster import metric_value
from radixserve.metrics import ServingMetrics
from radixserve.services.autoscaler.connectors import Connector, DryRunConnector, Replicas
from radixserve.services.autoscaler.metrics_source import observation_between, parse_exposition
from radixserve.services.autoscaler.observation import Observation
from radixserve.services.autoscaler.service import AutoscalerService
from radixserve.services.autoscaler.settings import AutoscalerSettings
from tests.autoscaler.test_metrics_source import worker


class _Scrapes:
    """The gateway's /metrics at 10 s intervals, one per `observe`."""

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.last = texts, None
        self.t = 0.0

    def observe(self, desired: Mapping[str, int | None]) -> Observation | None:
        text, self.texts = self.texts[0], self.texts[1:]
        last, self.last = self.last, text
        self.t += 10.0
        if last is None:
            return None  # the first scrape is a baseline
        return observation_between(parse_exposition(last), parse_exposition(text), 10.0,
                                   self.t, desired)  # fmt: skip

    def close(self) -> None:
        pass


def exposition(m: ServingMetrics, prefill_s: float, served: list[tuple[int, float]]) -> str:
    """The gateway's /metrics with one prefill worker (8k tokens/s) that has served
    ``served`` and one decode worker."""
    tokens = sum(n for n, _ in served)
    return m.render({}, {
        "prefill-0": worker("prefill", 600 + prefill_s, served, prefill_tokens=tokens,
                            prefill_seconds=prefill_s, busy_seconds=prefill_s),
        "decode-0": worker("decode", 600),
    }).decode()  # fmt: skip


def test_an_infeasible_prompt_is_logged_counted_and_advised_not_scaled_for(caplog):
    settings = AutoscalerSettings(ttft_p90_target_s=1.0, cold_start_s=0, min_prefill=1,
                                  max_prefill=4, port=0)  # fmt: skip
    m = ServingMetrics()
    short = [(1000, 0.0)] * 20
    texts = [  # then a prompt of 20k uncached tokens (2.5 s alone), then one of 40k (5 s)
        exposition(m, 2.5, short),
        exposition(m, 5.0, short + [(20000, 0.0)]),
        exposition(m, 10.0, short + [(20000, 0.0), (40000, 0.0)]),
    ]
    connector = DryRunConnector()
    service = AutoscalerService(settings, source=_Scrapes(texts), connector=connector)
    caplog.set_level(logging.INFO, logger="radixserve.services.autoscaler.service")
    assert service.tick() == []  # the baseline
    for _ in range(2):
        decisions = {d.role: d for d in service.tick()}
        assert decisions["prefill"].direction == "hold", decisions["prefill"]
        assert decisions["prefill"].infeasible == 1
    assert connector.wanted == {}  # nothing was set
    text = service._render().decode()
    assert metric_value(text, "radixserve_autoscaler_infeasible_requests_total", slo="ttft") == 2
    assert metric_value(text, "radixserve_autoscaler_advice", slo="ttft", remedy="prefill_tp") == 1
    assert metric_value(text, "radixserve_autoscaler_advice", slo="itl", remedy="decode_tp") == 0
    logged = caplog.text
    assert logged.count("prefill: 1 infeasible request(s)") == 2
    loud = [r for r in caplog.records if r.levelno >= logging.WARNING and "infeasible" in r.msg]
    assert len(loud) == 1  # a warning at first, then at most every few minutes
    assert logged.count("cannot meet the 1 s TTFT target") == 1  # advice: once, not per interval
    assert "--prefill-tp" in logged


class _Recording(Connector):
    """Pools of one replica each; records what it is asked to set."""

    name = "recording"

    def __init__(self) -> None:
        self.sets: list[tuple[str, int]] = []

    def get(self, role: str) -> Replicas | None:
        return Replicas(1, 1)

    def set(self, role: str, replicas: int) -> None:
        self.sets.append((role, replicas))


def scale_up_round(recommend_only: bool) -> tuple[list[tuple[str, int]], str]:
    """Two intervals of a prefill worker busy all the time (12k tokens/s asked of one
    that computes 12k): the policy scales prefill to 2. What was set, and /metrics."""
    settings = AutoscalerSettings(ttft_p90_target_s=1.0, cold_start_s=0, min_prefill=1,
                                  max_prefill=4, port=0, recommend_only=recommend_only)  # fmt: skip
    m = ServingMetrics()
    texts = [exposition(m, 10.0 * k, [(2000, 0.5)] * (60 * k)) for k in (1, 2)]
    connector = _Recording()
    service = AutoscalerService(settings, source=_Scrapes(texts), connector=connector)
    assert service.tick() == []  # the baseline
    decisions = {d.role: d for d in service.tick()}
    assert (decisions["prefill"].direction, decisions["prefill"].desired) == ("up", 2)
    return connector.sets, service._render().decode()


def test_recommendation_mode_exports_the_decision_and_sets_nothing():
    """With ``recommend_only`` the same decision is exported (for KEDA's Prometheus
    trigger) and the pool is never set; without it, it is set."""
    sets, text = scale_up_round(recommend_only=True)
    assert sets == []
    assert metric_value(text, "radixserve_autoscaler_desired_replicas", role="prefill") == 2
    sets, text = scale_up_round(recommend_only=False)
    assert sets == [("prefill", 2)]
    assert metric_value(text, "radixserve_autoscaler_desired_replicas", role="prefill") == 2
