"""A decode worker's settings: environment prefix ``RADIXSERVE_DECODE_``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from radixserve.runtime.settings import WorkerSettings


class DecodeSettings(WorkerSettings):
    """A decode worker's settings, from ``RADIXSERVE_DECODE_*``."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_DECODE_", frozen=True, extra="forbid")

    prefill_workers: list[str] = Field(
        default_factory=list,
        max_length=1024,
        description="Control addresses of the prefill workers (tcp://host:port); empty = "
        "always prefill locally. From the environment as a JSON list.",
    )
    local_prefill_max_tokens: int = Field(
        256,
        ge=0,
        description="Prefill here, moving no KV, when at most this many prompt tokens are "
        "not already cached on this worker (conditional disaggregation).",
    )
    on_transfer_failure: Literal["recompute", "fail"] = Field(
        "recompute",
        description="When remote prefill or its KV transfer fails: prefill locally, or fail "
        "the request.",
    )
    token_endpoint: bool = Field(
        True,
        description="Stream tokens to gateways on a token endpoint the engine thread sends on "
        "itself (false: on the control socket, through the event loop).",
    )
    token_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="The token endpoint's port, on the control socket's host (0: any free "
        "port; gateways learn it in the handshake).",
    )
    prefill_timeout_s: float = Field(
        300.0, gt=0, le=86400, description="Longest wait for a prefill worker's KVReady."
    )
    transfer_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest wait for one KV page transfer."
    )
    prefill_cache_weight: float = Field(
        1.0,
        ge=0,
        description="Prefill routing: weight of the pages a worker would have to compute "
        "(the prompt's pages less the prefix the kvstore index says it holds).",
    )
    prefill_load_weight: float = Field(
        1.0,
        ge=0,
        description="Prefill routing: weight of a worker's queued prompt tokens, in pages.",
    )
    prefill_host_hit_weight: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Prefill routing: cost of loading a page from the kvstore's host tier, "
        "relative to computing it.",
    )
    prefill_busy_tokens: int = Field(
        65536,
        ge=1,
        description="Prefill routing: a worker with more queued prompt tokens is skipped "
        "while another is under the threshold.",
    )
