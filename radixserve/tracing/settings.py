"""`OtlpSettings`: OpenTelemetry's standard environment variables, the subset radixserve
honours (https://opentelemetry.io/docs/specs/otel/protocol/exporter/ and
https://opentelemetry.io/docs/specs/otel/configuration/sdk-environment-variables/).

They keep their standard names (``OTEL_EXPORTER_OTLP_ENDPOINT``...), not a
``RADIXSERVE_`` prefix, so one collector configuration serves radixserve and everything
beside it. Every process (gateway, workers) reads them once at start-up.
"""

from __future__ import annotations

from typing import Literal
from urllib.parse import unquote

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

TRACES_PATH = "/v1/traces"
SUPPORTED_PROTOCOL = "http/json"


class OtlpSettings(BaseSettings):
    """Where and how spans are exported over OTLP/HTTP; no endpoint = no export."""

    model_config = SettingsConfigDict(env_prefix="OTEL_", frozen=True, extra="ignore")

    exporter_otlp_endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://",
        description="Base URL of the collector (http://host:4318); spans go to "
        "<endpoint>/v1/traces. Set = tracing on in every process that has it.",
    )
    exporter_otlp_traces_endpoint: str | None = Field(
        None,
        max_length=2048,
        pattern=r"^https?://",
        description="Full URL spans are posted to, used as is; wins over the base endpoint.",
    )
    exporter_otlp_headers: str = Field(
        "", max_length=8192, description="Headers of each export: k1=v1,k2=v2 (URL-encoded)."
    )
    exporter_otlp_traces_headers: str = Field(
        "", max_length=8192, description="Headers of each trace export; win over the above."
    )
    exporter_otlp_timeout: int = Field(
        10_000, ge=1, le=600_000, description="Milliseconds one export may take."
    )
    exporter_otlp_traces_timeout: int | None = Field(
        None, ge=1, le=600_000, description="Milliseconds one trace export may take."
    )
    exporter_otlp_protocol: Literal["http/json", "http/protobuf", "grpc"] | None = Field(
        None, description="Only http/json is spoken (unset means http/json here)."
    )
    exporter_otlp_traces_protocol: Literal["http/json", "http/protobuf", "grpc"] | None = Field(
        None, description="As OTEL_EXPORTER_OTLP_PROTOCOL, for traces."
    )
    service_name: str | None = Field(
        None,
        min_length=1,
        max_length=256,
        description="The resource's service.name; unset = radixserve-<role> "
        "(radixserve-gateway, radixserve-decode, radixserve-prefill).",
    )
    resource_attributes: str = Field(
        "", max_length=8192, description="More resource attributes: k1=v1,k2=v2 (URL-encoded)."
    )
    sdk_disabled: bool = Field(False, description="true = no export whatever else is set.")
    traces_exporter: Literal["otlp", "none"] = Field(
        "otlp", description="none = no export (the gateway's in-memory traces stay)."
    )
    bsp_schedule_delay: int = Field(
        5000, ge=1, le=600_000, description="Milliseconds between two exports of a batch."
    )
    bsp_max_queue_size: int = Field(
        2048, ge=1, le=1 << 20, description="Spans waiting for export; more are dropped."
    )
    bsp_max_export_batch_size: int = Field(
        512, ge=1, le=1 << 16, description="Most spans in one export."
    )

    def traces_url(self) -> str | None:
        """Where spans are posted, or None when nothing is to be exported."""
        if self.sdk_disabled or self.traces_exporter == "none":
            return None
        if self.exporter_otlp_traces_endpoint:
            return self.exporter_otlp_traces_endpoint
        if self.exporter_otlp_endpoint:
            return self.exporter_otlp_endpoint.rstrip("/") + TRACES_PATH
        return None

    def protocol_error(self) -> str | None:
        """Why the configured protocol cannot be served, or None."""
        for name in ("exporter_otlp_traces_protocol", "exporter_otlp_protocol"):
            value = getattr(self, name)
            if value is not None:
                if value != SUPPORTED_PROTOCOL:
                    return (
                        f"OTEL_{name.upper()}={value} is not supported: radixserve exports "
                        f"OTLP/HTTP with JSON bodies; set it to {SUPPORTED_PROTOCOL} or unset it"
                    )
                return None
        return None

    def headers(self) -> dict[str, str]:
        return {**_pairs(self.exporter_otlp_headers), **_pairs(self.exporter_otlp_traces_headers)}

    def timeout_s(self) -> float:
        return (self.exporter_otlp_traces_timeout or self.exporter_otlp_timeout) / 1000.0

    def resource(self, role: str) -> dict[str, str]:
        """The resource attributes of a process of ``role``: OTEL_RESOURCE_ATTRIBUTES,
        then service.name (OTEL_SERVICE_NAME wins, as the specification says), and the
        role, so processes sharing one OTEL_SERVICE_NAME are still told apart."""
        resource = _pairs(self.resource_attributes)
        resource["service.name"] = (
            self.service_name or resource.get("service.name") or f"radixserve-{role}"
        )
        resource["radixserve.role"] = role
        resource.setdefault("telemetry.sdk.name", "radixserve")
        resource.setdefault("telemetry.sdk.language", "python")
        return resource


def _pairs(text: str) -> dict[str, str]:
    """``k1=v1,k2=v2`` with URL-encoded values (the OTEL_* list format); entries
    without ``=`` are skipped."""
    pairs: dict[str, str] = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            pairs[key.strip()] = unquote(value.strip())
    return pairs
