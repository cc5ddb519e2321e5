"""A prefill worker's settings: environment prefix ``RADIXSERVE_PREFILL_``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from radixserve.runtime.settings import WorkerSettings


class PrefillSettings(WorkerSettings):
    """A prefill worker's settings, from ``RADIXSERVE_PREFILL_*``."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_PREFILL_", frozen=True, extra="forbid")

    lease_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long computed pages wait for the decode worker to read them.",
    )
