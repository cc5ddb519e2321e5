"""The kvstore's settings: environment prefix ``RADIXSERVE_KVSTORE_``."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.runtime.settings import KVEventsSettings, ServiceSettings, TransferSettings
from radixserve.services.kvstore.tier import BUILT_IN, tier_spec

_CONFIG = SettingsConfigDict(env_prefix="RADIXSERVE_KVSTORE_", frozen=True, extra="forbid")


class DiskTierSettings(BaseSettings):
    """The disk tier's settings (`services.kvstore.disk_pool`), part of the kvstore's."""

    model_config = _CONFIG

    disk_tier_dir: Path | None = Field(
        None,
        description="Directory of the disk tier: pages evicted from the host tier are "
        "written to files here, read back on a hit, and found again after a restart; "
        "unset = no disk tier. Use a local SSD.",
    )
    disk_tier_gib: float = Field(
        64.0,
        gt=0,
        le=1 << 20,
        description="Bound of the disk tier's files in disk_tier_dir (allocated as pages "
        "arrive, in eighths); past it the least recently used pages are overwritten.",
    )
    disk_write_buffer_mib: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Host memory that pages evicted from the host tier wait in until "
        "they are written to disk; when it is full, further evicted pages are not written "
        "(counted in disk_write_dropped_pages_total).",
    )
    disk_flush_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="On stop, how long the host tier's pages the disk tier lacks may take "
        "to be written there, so that a restart finds them; 0 = not written.",
    )
    disk_read_overlap: bool = Field(
        True,
        description="Overlap a disk hit's reads: the worker is leased the run at once and "
        "reads its pages into device memory chunk by chunk while the rest are still "
        "read from disk (false: the whole run is read into host memory first).",
    )
    disk_read_chunk_mib: float = Field(
        16.0,
        ge=0,
        le=1 << 20,
        description="Least bytes of a chunk of an overlapped disk read (at most 8 chunks "
        "a read; 0 = as small as a page): each chunk costs the worker a message and a "
        "transfer of its own, which a chunk of ~30 ms of disk reading hides.",
    )
    disk_reclaim_others: bool = Field(
        False,
        description="Remove, when the disk tier starts, the slabs of another model "
        "identity or page layout found in disk_tier_dir (by default they are left alone: "
        "counted in disk_foreign_pages and never served; their files stay until removed "
        "by hand or with this).",
    )


class KVStoreSettings(ServiceSettings, TransferSettings, KVEventsSettings, DiskTierSettings):
    """The kvstore's settings, from ``RADIXSERVE_KVSTORE_*`` (``_KV_EVENTS_*``: its tiers'
    pages as KV events in vLLM's format, `services.kvstore.tier_events`)."""

    model_config = _CONFIG

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
    tiers: tuple[str, ...] = Field(
        ("disk",),
        max_length=8,
        description="The tiers below the host tier, fastest first, each fed a copy of what "
        "the host tier evicts: a built-in name (disk: on when disk_tier_dir is set) or the "
        "module path of a tier (services/kvstore/tier.py says how to add one).",
    )
    member_refresh_s: float = Field(
        2.0, gt=0, le=600, description="Period of the member list sent to every watcher."
    )

    @field_validator("tiers")
    @classmethod
    def _check_tiers(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if len(set(names)) < len(names):
            raise ValueError(f"tiers: a tier is listed twice in {list(names)}")
        for name in names:
            if name not in BUILT_IN:
                tier_spec(name)  # a module path: it must expose its TIER
        return names

    @model_validator(mode="after")
    def _check_disk_tier(self) -> KVStoreSettings:
        if self.disk_tier_dir is not None and self.host_capacity_gib == 0:
            raise ValueError(
                "disk_tier_dir needs a host tier (host_capacity_gib > 0): the disk tier "
                "holds what the host tier evicts"
            )
        if self.kv_events_endpoint is not None and self.host_capacity_gib == 0:
            raise ValueError(
                "kv_events_endpoint needs a host tier (host_capacity_gib > 0): the kvstore "
                "publishes the pages of its tiers, and without one it stores none"
            )
        plugged = [name for name in self.tiers if name not in BUILT_IN]
        if plugged and self.host_capacity_gib == 0:
            raise ValueError(f"tiers: {plugged} need a host tier (host_capacity_gib > 0)")
        return self
