"""The kvstore's settings: environment prefix ``RADIXSERVE_KVSTORE_``."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import SettingsConfigDict

from radixserve.runtime.settings import ServiceSettings, TransferSettings


class KVStoreSettings(ServiceSettings, TransferSettings):
    """The kvstore's settings, from ``RADIXSERVE_KVSTORE_*``."""

    model_config = SettingsConfigDict(env_prefix="RADIXSERVE_KVSTORE_", frozen=True, extra="forbid")

    host_capacity_gib: float = Field(
        4.0,
        ge=0,
        le=65536,
        description="Size of the host-memory page pool workers spill into (allocated when "
        "the first worker attaches); 0 = index only, no host tier.",
    )
    host_lease_s: float = Field(
        60.0,
        gt=0,
        le=3600,
        description="How long a worker may take to read leased pages; keep it above the "
        "workers' host_load_timeout_s.",
    )
    host_transfer_timeout_s: float = Field(
        30.0,
        gt=0,
        le=100,
        description="Longest read of a worker's spilled pages (a worker reuses the buffer "
        "pages of a kvstore it lost after 120 s).",
    )
    member_refresh_s: float = Field(
        2.0, gt=0, le=600, description="Period of the member list sent to every watcher."
    )
