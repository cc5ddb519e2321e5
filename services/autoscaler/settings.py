"""Autoscaler settings: one pydantic-settings class, environment prefix
``RADIXSERVE_AUTOSCALER_``. Built once by the entry point and passed down; never mutated."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class AutoscalerSettings(BaseSettings):
    """SLO targets, pool bounds, the control loop's timing, where metrics come from and
    how replica counts are set."""

    model_config = SettingsConfigDict(
        env_prefix="RADIXSERVE_AUTOSCALER_", frozen=True, extra="forbid"
    )

    ttft_p90_target_s: float = Field(
        2.0, gt=0, le=3600, description="SLO: 90th percentile time to first token."
    )
    itl_p90_target_s: float = Field(
        0.1, gt=0, le=60, description="SLO: 90th percentile inter-token latency."
    )
    ttft_per_1k_tokens_s: float | None = Field(
        None,
        gt=0,
        le=3600,
        description="Optional per-token TTFT budget for long prompts: a request's target is "
        "max(ttft_p90_target_s, this x uncached tokens / 1000). Off by default.",
    )
    min_prefill: int = Field(0, ge=0, le=1024, description="Fewest prefill replicas.")
    max_prefill: int = Field(8, ge=0, le=1024, description="Most prefill replicas.")
    min_decode: int = Field(1, ge=1, le=1024, description="Fewest decode replicas.")
    max_decode: int = Field(8, ge=1, le=1024, description="Most decode replicas.")
    interval_s: float = Field(10.0, gt=0, le=3600, description="Period of the control loop.")
    scale_up_cooldown_s: float = Field(
        30.0, ge=0, le=86400, description="Least time between two scale-ups of a pool."
    )
    scale_down_cooldown_s: float = Field(
        120.0, ge=0, le=86400, description="Least time from any change of a pool to a scale-down."
    )
    target_utilization: float = Field(
        0.7,
        gt=0,
        le=1,
        description="Share of a replica's measured capacity the throughput model plans to "
        "use (headroom for bursts and queueing).",
    )
    scale_down_utilization: float = Field(
        0.6,
        gt=0,
        le=1,
        description="Scale down only while N-1 replicas would run below this utilisation "
        "(util * N / (N - 1)).",
    )
    demand_relative_error: float = Field(
        0.15,
        ge=0.01,
        le=1,
        description="Demand is measured over the last intervals holding enough requests "
        "that its relative error, sqrt((1 + cv2) / requests) with cv2 the squared "
        "coefficient of variation of their uncached tokens, is this (at least one interval, "
        "at most max(interval_s, scale_down_cooldown_s)): with long-tailed prompts a short "
        "sample is dominated by its longest prompt.",
    )
    queue_tokens_per_replica: int = Field(
        16384,
        ge=1,
        description="Fast step: prompt tokens queued per prefill replica above this add one.",
    )
    scale_up_min_gain: float = Field(
        0.05,
        ge=0,
        le=1,
        description="Diminishing returns: past what the throughput model needs, a replica is "
        "added only if it is predicted to take at least this share of the pool's latency "
        "target (TTFT or ITL) off the measured queueing delay.",
    )
    max_replica_seconds_per_interval: float | None = Field(
        None,
        gt=0,
        description="Hard ceiling on the replica-seconds of both pools per interval "
        "(replicas x interval_s): scale-ups past it are refused, prefill's first. Off by "
        "default.",
    )
    infeasible_advice_share: float = Field(
        0.05,
        gt=0,
        le=1,
        description="Once this share of the requests of the last 5 minutes cannot meet an SLO "
        "on any number of replicas, the log and /metrics name the remedies.",
    )
    cold_start_s: float = Field(
        60.0,
        ge=0,
        le=3600,
        description="A worker this young is left out of capacity estimates (warm-up).",
    )
    metrics_source: Literal["gateway", "prometheus"] = Field(
        "gateway", description="Read the gateway's /metrics, or a Prometheus query API."
    )
    gateway_url: str = Field(
        "http://127.0.0.1:8000", min_length=1, max_length=1024, description="The gateway."
    )
    prometheus_url: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="Prometheus, for metrics_source=prometheus.",
    )
    prometheus_window_s: float = Field(
        60.0, gt=0, le=3600, description="Range of Prometheus rate() and quantile queries."
    )
    connector: Literal["local", "kubernetes", "dry-run"] = Field(
        "dry-run",
        description="How replica counts are set: radixserve up's pools, Kubernetes "
        "Deployments' scale subresource, or only decided and logged.",
    )
    recommend_only: bool = Field(
        False,
        description="Recommendation mode: read the pools' replicas through the connector, "
        "decide and export radixserve_autoscaler_desired_replicas, but never set them; "
        "an external scaler (KEDA's Prometheus trigger, an HPA on external metrics) acts "
        "on the recommendation.",
    )
    local_url: str | None = Field(
        None,
        min_length=1,
        max_length=1024,
        description="radixserve up's pool-size API (it prints it), for connector=local.",
    )
    kubernetes_namespace: str = Field(
        "default", min_length=1, max_length=253, description="Namespace of the Deployments."
    )
    kubernetes_prefill_deployment: str = Field(
        "radixserve-prefill", min_length=1, max_length=253, description="Prefill Deployment."
    )
    kubernetes_decode_deployment: str = Field(
        "radixserve-decode", min_length=1, max_length=253, description="Decode Deployment."
    )
    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="HTTP listen address.")
    port: int = Field(
        8090, ge=0, le=65535, description="HTTP port of /health, /live and /metrics (0 = any)."
    )
    listen_fd: int | None = Field(
        None,
        ge=0,
        description="A listening TCP socket inherited from the process that started this "
        "one (radixserve up's supervisor binds it and keeps it, so the port stays across "
        "restarts): served on instead of binding host:port.",
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalerSettings:
        if self.min_prefill > self.max_prefill:
            raise ValueError(f"min_prefill {self.min_prefill} > max_prefill {self.max_prefill}")
        if self.min_decode > self.max_decode:
            raise ValueError(f"min_decode {self.min_decode} > max_decode {self.max_decode}")
        if self.connector == "local" and not self.local_url:
            raise ValueError("connector=local needs local_url (radixserve up prints it)")
        if self.metrics_source == "prometheus" and not self.prometheus_url:
            raise ValueError("metrics_source=prometheus needs prometheus_url")
        ceiling = self.max_replica_seconds_per_interval
        floor_s = (self.min_prefill + self.min_decode) * self.interval_s
        if ceiling is not None and ceiling < floor_s:
            raise ValueError(
                f"max_replica_seconds_per_interval {ceiling:g} is below the pools' minimum "
                f"(min_prefill + min_decode) x interval_s = {floor_s:g}"
            )
        return self

    @property
    def max_replicas(self) -> int | None:
        """Both pools' replicas the replica-seconds ceiling allows (None: no ceiling)."""
        ceiling = self.max_replica_seconds_per_interval
        return None if ceiling is None else int(ceiling / self.interval_s + 1e-9)

    def bounds(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode
