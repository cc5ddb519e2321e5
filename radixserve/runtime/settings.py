"""Settings shared by the services, declared once each: `PeerSettings` (every process on
the internal plane, the gateway too), `ServiceSettings` (a process with a control
socket), `TransferSettings` (a process whose pages peers read) and `WorkerSettings`
(prefill and decode workers). Each service's own class (``services/<name>/settings.py``)
adds its fields and its ``RADIXSERVE_<SERVICE>_`` prefix."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from radixserve.protocol.security import (
    CLUSTER_SECRET_ALIAS,
    SECRET_SETTING,
    is_loopback,
    is_placeholder,
    require_secret,
)
from radixserve.transfer import Backend
from radixserve.transfer.network import TransferNetwork


class PeerSettings(BaseSettings):
    """What every process on the cluster's internal plane has, the gateway included: how
    often it beats, when a silent peer is dead, and the cluster's secret."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    heartbeat_interval_s: float = Field(0.5, gt=0, le=60, description="Heartbeat period.")
    peer_timeout_s: float = Field(
        5.0, gt=0, le=600, description="A peer silent this long is considered dead."
    )
    cluster_secret: SecretStr | None = Field(
        None,
        min_length=16,
        validation_alias=CLUSTER_SECRET_ALIAS,
        description="Shared secret of the cluster's internal plane (one variable, "
        "RADIXSERVE_CLUSTER_SECRET, for every service): every control socket uses "
        "CurveZMQ with keys derived from it and transfer metadata is signed, so nothing "
        "without it gets through; unset = no authentication, allowed on loopback only (a "
        "service listening on another address refuses to start without it).",
    )

    @field_validator("cluster_secret")
    @classmethod
    def _not_a_placeholder(cls, secret: SecretStr | None) -> SecretStr | None:
        if secret is not None and is_placeholder(secret.get_secret_value()):
            raise ValueError(f"{SECRET_SETTING} is still the example's placeholder: make your "
                             "own (openssl rand -hex 32)")  # fmt: skip
        return secret


class ServiceSettings(PeerSettings):
    """Settings every service process that listens (workers, the kvstore) has; each
    service's class adds its own."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    name: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="Service name, unique in the cluster; default '<role>-<port>' on "
        "127.0.0.1, else '<role>-<advertised host>-<port>' (replicas sharing a port, as "
        "in compose, differ by host).",
    )
    host: str = Field("127.0.0.1", min_length=1, max_length=255, description="Listen address.")
    port: int = Field(0, ge=0, le=65535, description="Control port (ZMQ); 0 = any free port.")
    listen_fd: int | None = Field(
        None,
        ge=0,
        description="A listening TCP socket inherited from the process that started this "
        "one (radixserve up's supervisor binds it and keeps it, so the port stays across "
        "restarts): the control socket serves on it instead of binding host:port.",
    )
    advertise_host: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Host name or address other services dial to reach this one (a pod IP, "
        "a compose service name); default: the listen host, or this machine's host name "
        "when listening on every interface.",
    )
    generation: int | None = Field(
        None, ge=0, description="Incarnation number; default: start time in milliseconds."
    )
    transfer_host: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Listen address of the KV transfer agents (ZMQ binds it; NIXL's UCX "
        "uses only the network interface holding it, every interface for 0.0.0.0); "
        "default: host. Peers dial advertise_host, or this address when it is another "
        "specific one.",
    )
    transfer_port_min: int = Field(
        0,
        ge=0,
        le=65535,
        description="Lowest port of the KV transfer agents' listeners (ZMQ's socket, UCX's "
        "TCP listeners; a worker has two agents, and UCX waits until a port of the range "
        "is free, so leave room); 0 with transfer_port_max 0 = any free port.",
    )
    transfer_port_max: int = Field(
        0, ge=0, le=65535, description="Highest port of the KV transfer agents' listeners."
    )
    http_host: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Listen address of the HTTP /health, /live and /metrics; default: host.",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="Port of the HTTP /health, /live and /metrics (for probes and "
        "Prometheus); unset = no HTTP side, 0 = any free port.",
    )
    drain_grace_s: float = Field(
        30.0,
        ge=0,
        le=86400,
        description="On SIGTERM, how long running requests may take to finish before they "
        "are aborted (keep Kubernetes' terminationGracePeriodSeconds above it).",
    )

    def exposed(self) -> list[str]:
        """The addresses this service listens on that other machines can reach (the
        control socket's and the transfer agents'; the HTTP probes carry no cluster data)."""
        hosts = {"host": self.host, "transfer_host": self.transfer_host or self.host}
        exposed: dict[str, list[str]] = {}
        for name, host in hosts.items():
            if not is_loopback(host):
                exposed.setdefault(host, []).append(name)
        return [f"{host} ({', '.join(names)})" for host, names in exposed.items()]

    def require_secure(self, service: str) -> None:
        """Refuse to start off loopback without the cluster secret (`InsecureBindError`)."""
        require_secret(self.cluster_secret, self.exposed(), service)

    @model_validator(mode="after")
    def _check_ports(self) -> ServiceSettings:
        TransferNetwork(port_min=self.transfer_port_min, port_max=self.transfer_port_max)
        return self


class TransferSettings(BaseSettings):
    """How KV pages move: every process that owns pages peers read (workers, the
    kvstore's host tier) has these."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    transfer_backend: Backend = Field(
        "nixl",
        description="How KV pages move between workers and the host tier: NIXL "
        "(UCX) or ZMQ over TCP; the same in the whole cluster.",
    )
    nixl_progress_thread: bool = Field(
        False,
        description="Give the NIXL agent its own progress thread (it busy-polls a CPU core); "
        "off, the process drives progress itself while a peer reads its pages.",
    )


def parse_tp(value: object) -> int | Literal["auto"]:
    """A worker's tensor-parallel size as given (a setting, a flag): 1 to 64, or 'auto'."""
    if value == "auto":
        return "auto"
    size = value if isinstance(value, int) else int(str(value)) if str(value).isdigit() else 0
    if isinstance(size, bool) or not 1 <= size <= 64:
        raise ValueError(f"{value!r} is not a tensor-parallel size from 1 to 64 or 'auto'")
    return size


def resolved_tp(tp: int | Literal["auto"]) -> int:
    """A worker's tensor-parallel size; 'auto' is one rank per CUDA device this process
    sees, so a container given N GPUs (CUDA_VISIBLE_DEVICES) splits its model N ways
    without a second setting saying N."""
    if tp != "auto":
        return tp
    import torch

    return max(1, torch.cuda.device_count())


class KVEventsSettings(BaseSettings):
    """A worker's radix-cache events (or the kvstore's tiers') in vLLM's format, for
    routers and indexers built for vLLM (`radixserve.runtime.kv_events`); the fields of
    vLLM's ``KVEventsConfig``."""

    model_config = SettingsConfigDict(frozen=True, extra="forbid")

    kv_events_publisher: Literal["zmq"] = Field(
        "zmq", description="How the events are published: 'zmq' (a ZMQ PUB socket), vLLM's."
    )
    kv_events_endpoint: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=r"^(tcp|ipc|inproc)://",
        description="ZMQ endpoint of the events' PUB socket; unset = no events. Bound when "
        "it has a wildcard host ('*', '::') or is ipc:// or inproc:// (port 0: any free "
        "port, logged), else connected to a subscriber that binds, as vLLM does.",
    )
    kv_events_replay_endpoint: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        pattern=r"^(tcp|ipc|inproc)://",
        description="ZMQ endpoint the ROUTER socket that replays buffered batches binds "
        "(a subscriber sends the first sequence number it lacks); unset = no replay.",
    )
    kv_events_topic: str = Field(
        "", max_length=255, description="Topic frame of every published batch."
    )
    kv_events_buffer_steps: int = Field(
        10_000, ge=1, le=1_000_000, description="Batches kept for replay."
    )
    kv_events_hwm: int = Field(
        100_000, ge=1, le=10_000_000, description="High-water mark of the PUB socket."
    )


class WorkerSettings(ServiceSettings, TransferSettings, KVEventsSettings):
    """Settings every worker has; `PrefillSettings` and `DecodeSettings` add their own."""

    kvstore: str | None = Field(
        None,
        min_length=1,
        max_length=255,
        description="Control address of the cluster's kvstore (tcp://host:port), on a "
        "cluster of several nodes this node's: the worker registers there (so routers find "
        "it), publishes its cache events and uses its host tier; none = a worker known only "
        "by static addresses.",
    )
    kvstores: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Control addresses of every kvstore of the cluster (one per node), in "
        "the same order on every process: the cache index is sharded over them by page hash "
        "and the worker registers with each, so losing one loses only its shard and its "
        "node's host tier. Must include kvstore; empty = kvstore alone. From the "
        "environment as a JSON list.",
    )
    tp: int | Literal["auto"] | None = Field(
        None,
        description="Tensor-parallel size of this worker: rank processes (one device each) "
        "its model is split over; 'auto' = one per CUDA device the process sees "
        "(CUDA_VISIBLE_DEVICES; 1 without one), as the compose GPU override sets it; none = "
        "the engine's RADIXSERVE_TP (default 1). Pages move between prefill and decode "
        "workers when one size divides the other.",
    )
    audit_sample_rate: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="This worker's cache audit sample rate; none = the engine's "
        "RADIXSERVE_AUDIT_SAMPLE_RATE (default 0: off).",
    )
    audit_fail_closed: bool | None = Field(
        None,
        description="Whether this worker's cache audit fails closed; none = the engine's "
        "RADIXSERVE_AUDIT_FAIL_CLOSED (default false).",
    )
    host_tier: bool = Field(
        True,
        description="Spill evicted pages into the kvstore's host tier and load prefixes "
        "missing on device from it (when the kvstore has one).",
    )
    host_spill_buffer_mib: int = Field(
        256,
        ge=1,
        le=1 << 20,
        description="Host buffer that evicted pages are copied into until the kvstore has "
        "read them; when full, further evicted pages are dropped.",
    )
    host_write_through_uses: int = Field(
        0,
        ge=0,
        le=1 << 20,
        description="Also write a cached prefix to the host tier once this many requests "
        "used it (1 = as soon as it is computed); 0 = only on eviction (write-back).",
    )
    host_load_min_tokens: int = Field(
        256,
        ge=0,
        le=1 << 20,
        description="Ask the host tier for a prefix only when more than this many prompt "
        "tokens are missing on device: a shorter delta is computed faster than the kvstore "
        "round trip and the read would take.",
    )
    host_lookup_timeout_s: float = Field(
        0.2, gt=0, le=60, description="Longest wait for the kvstore's host-tier lookup."
    )
    host_load_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="Longest read of host-tier pages."
    )
    kvstore_query_timeout_s: float = Field(
        0.05,
        gt=0,
        le=10,
        description="Longest wait for the kvstore index per request; past it, prefill is "
        "routed by load alone and no peer's pages are read.",
    )
    peer_reads: bool = Field(
        True,
        description="Read a prompt's prefix from another worker's device cache (the "
        "kvstore's index says who holds it) when more than host_load_min_tokens of it are "
        "missing here, the holder has more of it than the host tier, and reading it is "
        "quicker than computing it.",
    )
    peer_lease_s: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="How long pages lent to another worker's read wait for it.",
    )
    peer_read_timeout_s: float = Field(
        10.0,
        gt=0,
        le=3600,
        description="Longest wait for a peer's pages (its answer and the read); past it, "
        "the prompt is computed.",
    )
    drain_linger_s: float = Field(
        10.0,
        ge=0,
        le=3600,
        description="On SIGTERM, once its requests are done, how long a draining worker "
        "still lends its cached pages to other workers (the conversations it served "
        "continue elsewhere without recomputing them) before it leaves; 0 = leave at once.",
    )

    @field_validator("tp", mode="before")
    @classmethod
    def _tp_size(cls, value: object) -> object:
        return None if value is None else parse_tp(value)

    @model_validator(mode="after")
    def _check_kvstores(self) -> WorkerSettings:
        prefix = str(self.model_config.get("env_prefix") or "").upper()
        check_kvstores(self.kvstore, self.kvstores, f"{prefix}KVSTORE")
        return self

    @property
    def index_shards(self) -> list[str]:
        """The kvstores the cache index is sharded over, in shard order."""
        return kvstore_list(self.kvstore, self.kvstores)


def kvstore_list(kvstore: str | None, kvstores: list[str]) -> list[str]:
    """Every kvstore of the cluster in shard order: ``kvstores``, or the one ``kvstore``."""
    return list(kvstores) if kvstores else [kvstore] if kvstore else []


def check_kvstores(kvstore: str | None, kvstores: list[str], variable: str) -> None:
    """ValueError unless ``kvstores`` (one per node, in shard order) are distinct and list
    this node's ``kvstore``."""
    if len(set(kvstores)) != len(kvstores):
        raise ValueError(f"{variable}S lists a kvstore twice: {kvstores}")
    if kvstores and kvstore is None:
        raise ValueError(f"{variable}S needs {variable}: which of them is this node's")
    if kvstores and kvstore not in kvstores:
        raise ValueError(f"{variable} {kvstore!r} is not among {variable}S {kvstores}: "
                         "list every kvstore of the cluster, this node's too")  # fmt: skip
