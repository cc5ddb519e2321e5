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

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.tracing.otlp import DEFAULT_PROTOCOL, PROTOCOLS

TRACES_PATH = "/v1/traces"


class OtlpSettings(BaseSettings):
    """Where and how spans are exported over OTLP; no endpoint = no export. `load`
    reads the environment, with errors that name the variables."""

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
    exporter_otlp_protocol: str | None = Field(
        None,
        description="http/protobuf (unset: the specification's default), http/json or grpc.",
    )
    exporter_otlp_traces_protocol: str | None = Field(
        None, description="As OTEL_EXPORTER_OTLP_PROTOCOL, for traces; wins over it."
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

    @field_validator("exporter_otlp_protocol", "exporter_otlp_traces_protocol")
    @classmethod
    def _spoken(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and value not in PROTOCOLS:
            raise ValueError(
                f"OTEL_{str(info.field_name).upper()}={value} is not supported: "
                f"use one of {', '.join(PROTOCOLS)} (unset: {DEFAULT_PROTOCOL})"
            )
        return value

    def protocol(self) -> str:
        """The protocol spans are exported over (the traces variable wins)."""
        return self.exporter_otlp_traces_protocol or self.exporter_otlp_protocol or DEFAULT_PROTOCOL

    def traces_url(self) -> str | None:
        """Where spans are sent, or None when nothing is to be exported: the traces
        endpoint as is; else the base endpoint, with ``/v1/traces`` over HTTP (gRPC
        takes it as is, as the specification says)."""
        if self.sdk_disabled or self.traces_exporter == "none":
            return None
        if self.exporter_otlp_traces_endpoint:
            return self.exporter_otlp_traces_endpoint
        if self.exporter_otlp_endpoint:
            if self.protocol() == "grpc":
                return self.exporter_otlp_endpoint
            return self.exporter_otlp_endpoint.rstrip("/") + TRACES_PATH
        return None

    @classmethod
    def load(cls) -> OtlpSettings:
        """The settings of this process's OTEL_* environment; `ValueError` naming each
        variable that is refused."""
        from_env: dict[str, object] = {}  # every field from OTEL_* / defaults
        try:
            return cls(**from_env)  # type: ignore[arg-type]
        except ValidationError as exc:
            raise ValueError("; ".join(_problem(e) for e in exc.errors())) from None

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


def _problem(error: object) -> str:
    """One pydantic error as ``OTEL_<NAME>: <what is wrong>`` (the message alone when
    it names its variable already)."""
    assert isinstance(error, dict)
    message = str(error["msg"]).removeprefix("Value error, ")
    variable = "OTEL_" + str(error["loc"][0]).upper() if error["loc"] else "OTEL_*"
    return message if message.startswith(variable) else f"{variable}: {message}"
