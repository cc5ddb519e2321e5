"""The autoscaler process: observe, decide, set, every ``interval_s``.

Each interval: read the pools' replica counts from the connector, build an `Observation`
from the metrics source, let `ScalingPolicy` decide, set the pools that change (never
with ``recommend_only``: the pools are read, and the exported recommendation is for an
external scaler such as KEDA), log every decision with its inputs and reason (and the
requests no replica count serves in time, and while a sizeable share of them lasts,
what to do instead), and export

    radixserve_autoscaler_desired_replicas{role}      what it decided
    radixserve_autoscaler_observed_replicas{role}     ready replicas it saw
    radixserve_autoscaler_decisions_total{role,direction,reason}
    radixserve_autoscaler_infeasible_requests_total{slo}   requests whose own work
                                                       exceeds the ttft / itl target
    radixserve_autoscaler_advice{slo,remedy}          1 while that remedy is advised
    radixserve_autoscaler_errors_total{stage}          metrics / connector failures

on its own HTTP port with ``/health`` (the latest round's decisions and the recent ones
that were not a steady hold: what the gateway's /explorer shows) and ``/live``
(`radixserve.runtime.probe`). A failed
scrape or connector call is logged and counted; the loop goes on. SIGTERM or SIGINT
stops it (no pool is changed on the way out).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from radixserve.runtime.probe import ProbeServer
from radixserve.runtime.service import wait_event
from radixserve.services.autoscaler.connectors import Connector, ConnectorError, make_connector
from radixserve.services.autoscaler.feasibility import REMEDIES
from radixserve.services.autoscaler.metrics_source import (
    GatewayMetrics,
    MetricsError,
    PrometheusMetrics,
)
from radixserve.services.autoscaler.observation import ROLES, SLO_OF, Decision
from radixserve.services.autoscaler.policy import ScalingPolicy
from radixserve.services.autoscaler.settings import AutoscalerSettings

logger = logging.getLogger(__name__)

REPEAT_S = 300.0  # infeasible requests and advice are logged as warnings this often
RECENT_DECISIONS = 64  # decisions /health lists (`AutoscalerService.recent`)


class AutoscalerMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.desired = Gauge("radixserve_autoscaler_desired_replicas", "Replicas decided.",
                             ["role"], registry=r)  # fmt: skip
        self.observed = Gauge("radixserve_autoscaler_observed_replicas",
                              "Ready replicas observed.", ["role"], registry=r)  # fmt: skip
        self.decisions = Counter("radixserve_autoscaler_decisions", "Scaling decisions.",
                                 ["role", "direction", "reason"], registry=r)  # fmt: skip
        self.errors = Counter("radixserve_autoscaler_errors", "Failed metric reads or "
                              "replica changes.", ["stage"], registry=r)  # fmt: skip
        self.infeasible = Counter("radixserve_autoscaler_infeasible_requests", "Requests whose "
                                  "own work exceeds the SLO target on any number of replicas "
                                  "(never scaled for).", ["slo"], registry=r)  # fmt: skip
        self.advice = Gauge("radixserve_autoscaler_advice", "1 while a sizeable share of "
                            "requests is infeasible and this remedy is advised instead of "
                            "replicas.", ["slo", "remedy"], registry=r)  # fmt: skip
        for role in ROLES:
            self.desired.labels(role=role)
            self.observed.labels(role=role)
        for slo, remedies in REMEDIES.items():
            self.infeasible.labels(slo=slo)
            for remedy, _ in remedies:
                self.advice.labels(slo=slo, remedy=remedy)
        for stage in ("metrics", "connector"):
            self.errors.labels(stage=stage)


class AutoscalerService:
    """The control loop; `run` until ``stop`` is set."""

    def __init__(
        self,
        settings: AutoscalerSettings,
        source: GatewayMetrics | PrometheusMetrics | None = None,
        connector: Connector | None = None,
    ) -> None:
        self.settings = settings
        self.policy = ScalingPolicy(settings)
        self.source = source or _make_source(settings)
        self.connector = connector or make_connector(settings)
        self.metrics = AutoscalerMetrics()
        self.last_decisions: list[Decision] = []
        # the latest decisions that changed something or said why not (holds of a steady
        # pool left out), newest last: /health lists them (the gateway's /explorer shows them)
        self.recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=RECENT_DECISIONS)
        self.last_ok_s: float | None = None
        self._advised_s: dict[str, float] = {}  # role -> when its advice was last logged
        self._infeasible_s: dict[str, float] = {}  # role -> when infeasible ones were
        self._infeasible_since: dict[str, float] = {role: 0.0 for role in ROLES}
        self.probe = ProbeServer(settings.host, settings.port, self._health, self._render,
                                 listen_fd=settings.listen_fd)  # fmt: skip

    async def run(self, stop: asyncio.Event) -> None:
        await self.probe.start()
        s = self.settings
        mode = " (recommendations only)" if s.recommend_only else ""
        print(f"radixserve autoscaler: {s.connector} connector{mode}, metrics from "
              f"{s.metrics_source}, every {s.interval_s:g} s; targets TTFT p90 "
              f"{s.ttft_p90_target_s:g} s, ITL p90 {s.itl_p90_target_s:g} s; "
              f"/metrics on {self.probe.url}", flush=True)  # fmt: skip
        try:
            while not stop.is_set():
                await asyncio.to_thread(self.tick)
                await wait_event(stop, s.interval_s)
        finally:
            await self.probe.close()
            self.source.close()
            self.connector.close()

    def tick(self) -> list[Decision]:
        """One round: observe, decide, set. Returns the decisions ([] if it could not)."""
        desired: dict[str, int | None] = {}
        for role in ROLES:
            try:
                replicas = self.connector.get(role)
            except ConnectorError as exc:
                self._error("connector", exc)
                return []
            desired[role] = replicas.desired if replicas is not None else None
        try:
            obs = self.source.observe(desired)
        except MetricsError as exc:
            self._error("metrics", exc)
            return []
        if obs is None:  # the first scrape is a baseline
            return []
        decisions = self.policy.decide(obs)
        for d in decisions:
            self.metrics.observed.labels(role=d.role).set(obs.pools[d.role].ready)
            self.metrics.desired.labels(role=d.role).set(d.desired)
            self.metrics.decisions.labels(role=d.role, direction=d.direction, reason=d.kind).inc()
            level = logging.WARNING if d.direction != "hold" else logging.INFO
            logger.log(level, "%s: %s %d -> %d (%s) %s", d.role, d.direction, d.current,
                       d.desired, d.reason, json.dumps(d.inputs))  # fmt: skip
            self._report_infeasible(d)
            if d.direction != "hold" and not self.settings.recommend_only:
                try:
                    self.connector.set(d.role, d.desired)
                except ConnectorError as exc:
                    self._error("connector", exc)
        self.last_decisions = decisions
        self.last_ok_s = time.monotonic()
        self.recent.extend(_as_record(d) for d in decisions if d.kind != "steady")
        return decisions

    def _report_infeasible(self, d: Decision) -> None:
        """Count and log the requests no replica count serves in time: each interval at
        INFO, and as a warning at most every `REPEAT_S`, with the count since the last."""
        slo, now = SLO_OF[d.role], time.monotonic()
        if d.infeasible > 0:
            self.metrics.infeasible.labels(slo=slo).inc(d.infeasible)
            self._infeasible_since[d.role] += d.infeasible
            last = self._infeasible_s.get(d.role)
            loud = last is None or now - last >= REPEAT_S
            count, since = d.infeasible, ""
            if loud:
                count = self._infeasible_since[d.role]
                since = "" if last is None else f" in the last {now - last:.0f} s"
                self._infeasible_s[d.role], self._infeasible_since[d.role] = now, 0.0
            logger.log(logging.WARNING if loud else logging.INFO,
                       "%s: %.0f infeasible request(s)%s: own work over the %s target on any "
                       "number of replicas; not scaled for %s", d.role, count, since,
                       slo.upper(), json.dumps(d.inputs))  # fmt: skip
        self._report_advice(d, slo, now)

    def _report_advice(self, d: Decision, slo: str, now: float) -> None:
        """The advice gauges; the advice logged when it starts, every `REPEAT_S` while
        it lasts, and when it ends."""
        for remedy, _ in REMEDIES[slo]:
            self.metrics.advice.labels(slo=slo, remedy=remedy).set(1 if d.advice else 0)
        last = self._advised_s.get(d.role)
        if d.advice and (last is None or now - last >= REPEAT_S):
            logger.warning("%s: %s", d.role, d.advice)
            self._advised_s[d.role] = now
        elif not d.advice and last is not None:
            logger.warning("%s: the infeasible share is no longer sizeable", d.role)
            del self._advised_s[d.role]

    def _error(self, stage: str, exc: Exception) -> None:
        self.metrics.errors.labels(stage=stage).inc()
        logger.warning("autoscaler %s: %s", stage, exc)

    def _health(self) -> tuple[bool, dict[str, Any]]:
        """Ready once a round has gone through, and while rounds keep going through."""
        ok = self.last_ok_s is not None and (
            time.monotonic() - self.last_ok_s < 3 * self.settings.interval_s + 30
        )
        detail = {
            "connector": self.connector.name,
            "decisions": [
                {
                    "role": d.role,
                    "desired": d.desired,
                    "reason": d.reason,
                    "infeasible": d.infeasible,
                    "advice": d.advice,
                }
                for d in self.last_decisions
            ],
            "recent_decisions": list(self.recent),
        }
        return ok, detail

    def _render(self) -> bytes:
        return generate_latest(self.metrics.registry)


def _as_record(d: Decision) -> dict[str, Any]:
    """A decision as /health lists it among the recent ones."""
    return {"time_s": round(time.time(), 3), "role": d.role, "direction": d.direction,
            "current": d.current, "desired": d.desired, "kind": d.kind, "reason": d.reason,
            "infeasible": d.infeasible, "advice": d.advice}  # fmt: skip


def _make_source(settings: AutoscalerSettings) -> GatewayMetrics | PrometheusMetrics:
    if settings.metrics_source == "prometheus":
        assert settings.prometheus_url is not None  # checked by the settings
        return PrometheusMetrics(settings.prometheus_url, settings.prometheus_window_s)
    return GatewayMetrics(settings.gateway_url)
