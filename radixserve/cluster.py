"""`radixserve up`: the whole local cluster as separate processes under one supervisor.

(`radixserve up` itself is `cli.cmd_up`; `LocalCluster` runs the same processes for
tests and benchmarks, supervised from the calling thread.)

`cluster_specs` turns a `ClusterConfig` into one `ProcessSpec` per process — prefill
workers, decode workers, then the gateway — each configured only through environment
settings (``RADIXSERVE_*``), exactly as compose or Kubernetes would run them. Workers
listen on free loopback ports; the gateway on ``host:port``. `radixserve up` runs them
under a `Supervisor`: it waits for the gateway's /health (`gateway_healthy`), prints the
URL, restarts whatever crashes and stops everything on Ctrl-C or SIGTERM.

CPU threads: unless ``num_threads`` is given, the machine's cores are split evenly
between the workers, so their compute threads do not fight over the same cores.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.supervisor import ProcessSpec, Supervisor

logger = logging.getLogger(__name__)

WORKER_ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class ClusterConfig:
    """What `radixserve up` starts (every field has a CLI flag)."""

    num_prefill: int = 1
    num_decode: int = 1
    kvstore: bool = True  # start the kvstore (the cluster-wide cache index and host tier)
    host_tier_gib: float | None = None  # the kvstore's host tier (None: its default)
    transport: str = "nixl"
    host: str = "127.0.0.1"
    port: int = 8000
    engine_env: dict[str, str] = field(default_factory=dict)  # RADIXSERVE_* for every worker
    prefill_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_PREFILL_*
    decode_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_DECODE_*
    gateway_env: dict[str, str] = field(default_factory=dict)  # extra RADIXSERVE_GATEWAY_*
    num_threads: int | None = None

    def __post_init__(self) -> None:
        if self.num_decode < 1:
            raise ValueError("a cluster needs at least one decode worker (--decode 1)")
        if self.num_prefill < 0:
            raise ValueError("--prefill must be 0 or more")
        if self.transport not in ("nixl", "zmq"):
            raise ValueError(f"--transport must be nixl or zmq, not {self.transport!r}")
        if self.host_tier_gib is not None and self.host_tier_gib < 0:
            raise ValueError("--host-tier-gib must be 0 (no host tier) or more")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cluster_specs(config: ClusterConfig) -> list[ProcessSpec]:
    """The processes of the cluster, workers first, each with its own environment."""
    workers = config.num_prefill + config.num_decode
    threads = config.num_threads or max(1, (os.cpu_count() or 1) // workers)
    base = {
        "RADIXSERVE_LOAD_PROGRESS": "false",
        "RADIXSERVE_NUM_THREADS": str(threads),
        "OMP_NUM_THREADS": str(threads),
        **config.engine_env,
    }
    specs: list[ProcessSpec] = []
    index: dict[str, str] = {}  # the kvstore's address for each service that talks to it
    if config.kvstore:
        port = free_port()
        env = {
            **base,
            "RADIXSERVE_KVSTORE_NAME": "kvstore",
            "RADIXSERVE_KVSTORE_PORT": str(port),
            "RADIXSERVE_KVSTORE_TRANSFER_BACKEND": config.transport,
        }
        if config.host_tier_gib is not None:
            env["RADIXSERVE_KVSTORE_HOST_CAPACITY_GIB"] = str(config.host_tier_gib)
        argv = [sys.executable, "-m", "radixserve.services.kvstore"]
        specs.append(ProcessSpec("kvstore", argv, env))
        index = {role: f"tcp://127.0.0.1:{port}" for role in ("PREFILL", "DECODE", "GATEWAY")}

    def workers_of(role: str, count: int, extra: dict[str, str]) -> list[str]:
        """Add ``count`` workers of ``role``; their control addresses."""
        addresses = []
        for i in range(count):
            name, port, prefix = f"{role}-{i}", free_port(), f"RADIXSERVE_{role.upper()}_"
            addresses.append(f"tcp://127.0.0.1:{port}")
            env = {
                **base,
                **({f"{prefix}KVSTORE": index[role.upper()]} if index else {}),
                f"{prefix}NAME": name,
                f"{prefix}PORT": str(port),
                f"{prefix}TRANSFER_BACKEND": config.transport,
                **extra,
            }
            argv = [sys.executable, "-m", f"radixserve.services.{role}"]
            specs.append(ProcessSpec(name, argv, env))
        return addresses

    prefill_addrs = workers_of("prefill", config.num_prefill, config.prefill_env)
    links = {"RADIXSERVE_DECODE_PREFILL_WORKERS": json.dumps(prefill_addrs)}
    decode_addrs = workers_of("decode", config.num_decode, {**links, **config.decode_env})
    env = {
        **base,
        "RADIXSERVE_GATEWAY_HOST": config.host,
        "RADIXSERVE_GATEWAY_PORT": str(config.port),
        "RADIXSERVE_GATEWAY_DECODE_WORKERS": json.dumps(decode_addrs),
        "RADIXSERVE_GATEWAY_PREFILL_WORKERS": json.dumps(prefill_addrs),
        **({"RADIXSERVE_GATEWAY_KVSTORE": index["GATEWAY"]} if index else {}),
        **config.gateway_env,
    }
    specs.append(ProcessSpec("gateway", [sys.executable, "-m", "radixserve.services.gateway"], env))
    return specs


def gateway_healthy(url: str, timeout_s: float = 1.0) -> bool:
    """True when ``url``/health answers 200 (every decode link the gateway needs is up)."""
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=timeout_s) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class LocalCluster:
    """The processes of `radixserve up` for tests and benchmarks: started (and /health
    waited for) on construction, supervised by `wait` from the calling thread, ended by
    `stop` (or leaving a ``with`` block)."""

    def __init__(
        self,
        config: ClusterConfig,
        *,
        restart_backoff_s: float = 0.2,
        startup_timeout_s: float = 180.0,
    ) -> None:
        self.config = config
        self.url = config.url
        self.supervisor = Supervisor(cluster_specs(config), restart_backoff_s=restart_backoff_s)
        self.supervisor.start()
        try:
            self.wait(lambda: gateway_healthy(self.url), startup_timeout_s, "cluster start")
            self.wait(lambda: all(w["up"] for w in self.workers().values()), 60, "workers up")
            # and every decode worker has its own links to the prefill workers up, so the
            # first request can prefill remotely
            self.wait(self._decode_links_up, 60, "decode workers' links to prefill workers")
        except BaseException:
            self.supervisor.stop()
            raise

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def wait(self, condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        """Poll ``condition`` (supervising meanwhile) until true; `TimeoutError` if not
        within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not condition():
            self.supervisor.poll()
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.1)

    def _decode_links_up(self) -> bool:
        decodes = [w for w in self.workers().values() if w["role"] == "decode"]
        return all(w.get("prefills_up", 0) >= self.config.num_prefill for w in decodes)

    def debug_cache(self) -> dict[str, Any]:
        """The gateway's /debug/cache: totals and per-worker stats."""
        with urllib.request.urlopen(f"{self.url}/debug/cache", timeout=10) as resp:
            body: dict[str, Any] = json.load(resp)
        return body

    def workers(self) -> dict[str, dict[str, Any]]:
        workers: dict[str, dict[str, Any]] = self.debug_cache()["workers"]
        return workers

    def wait_host_tier(self, timeout_s: float = 60.0) -> None:
        """Wait until every prefill and decode worker has attached to the kvstore's host
        tier (until then, evicted pages are dropped rather than spilled)."""

        def attached() -> bool:
            workers = [w for w in self.workers().values() if w.get("role") in WORKER_ROLES]
            return bool(workers) and all(w.get("up") and w.get("host_attached") for w in workers)

        self.wait(attached, timeout_s, "the workers to attach to the host tier")

    def stop(self) -> None:
        self.supervisor.stop()
