"""`LocalCluster`: the processes of `radixserve up` (`radixserve.launch.cluster`) for the
benchmarks and the cluster tests, supervised from the calling thread."""

from __future__ import annotations

import dataclasses
import json
import os
import time
import urllib.request
from collections.abc import Callable
from typing import Any

from radixserve.launch.cluster import (
    ClusterConfig,
    ClusterProcesses,
    build_cluster,
    gateway_healthy,
)
from radixserve.transfer.shards import tp_pair_error

WORKER_ROLES = ("prefill", "decode")


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
        keys = json.loads(config.gateway_env.get("RADIXSERVE_GATEWAY_API_KEYS", "[]"))
        admins = [k["key"] for k in keys if isinstance(k, dict) and k.get("role") == "admin"]
        self.api_key: str | None = admins[0] if admins else None  # what /debug/cache is asked with
        self.processes = build_cluster(config, restart_backoff_s=restart_backoff_s)
        self.url = self.processes.url  # with port 0, the port bound
        self.config = dataclasses.replace(config, port=int(self.url.rsplit(":", 1)[1]))
        self.supervisor = self.processes.supervisor
        try:
            self.supervisor.start()
            self.wait(lambda: gateway_healthy(self.url), startup_timeout_s, "cluster start")
            self.wait(self._workers_up, 60, "every worker up at the gateway")
            # and every decode worker has its own links to the prefill workers up, so the
            # first request can prefill remotely
            self.wait(self._decode_links_up, 60, "decode workers' links to prefill workers")
        except BaseException:
            self.processes.stop()
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
            supervise(self.processes)
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout_s} s waiting for {what}")
            time.sleep(0.1)

    def _workers_up(self) -> bool:
        workers = self.workers()
        counts = {"prefill": self.config.num_prefill, "decode": self.config.num_decode}
        for role, count in counts.items():
            up = [w for w in workers.values() if w["role"] == role and w["up"]]
            if len(up) < count:
                return False
        return all(w["up"] for w in workers.values())

    @property
    def control_url(self) -> str | None:
        """The pools' control API (None without the kvstore)."""
        return self.processes.control.url if self.processes.control else None

    def _decode_links_up(self) -> bool:
        if tp_pair_error(self.config.prefill_tp, self.config.decode_tp):
            return True  # the decode workers refuse those links (and prefill themselves)
        decodes = self._decodes().values()
        return all(w.get("prefills_up", 0) >= self.config.num_prefill for w in decodes)

    def debug_cache(self) -> dict[str, Any]:
        """The gateway's /debug/cache: totals and per-worker stats."""
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        request = urllib.request.Request(f"{self.url}/debug/cache", headers=auth)
        with urllib.request.urlopen(request, timeout=10) as resp:
            body: dict[str, Any] = json.load(resp)
        return body

    def workers(self) -> dict[str, dict[str, Any]]:
        workers: dict[str, dict[str, Any]] = self.debug_cache()["workers"]
        return workers

    def worker(self, name: str) -> dict[str, Any]:
        """One worker as the gateway sees it; ``{"up": False}`` while the gateway knows
        none of that name (a dead worker leaves the membership until it is back)."""
        return self.workers().get(name, {"up": False})

    def wait_restarted(self, name: str, old_generation: int, timeout_s: float = 120) -> None:
        """Wait until ``name`` is up again under another generation (a restart), and every
        decode worker has its link to each prefill worker up again, as told by a heartbeat
        sent after that (until then a decode worker prefills what it is sent itself)."""

        def back() -> bool:
            w = self.worker(name)
            return bool(w["up"]) and w.get("generation") != old_generation

        self.wait(back, timeout_s, f"{name} to come back")
        beats = {key: w.get("heartbeats_total", 0) for key, w in self._decodes().items()}

        def links_up() -> bool:
            decodes = self._decodes()
            fresh = all(w.get("heartbeats_total", 0) > beats.get(key, -1)
                        for key, w in decodes.items())  # fmt: skip
            return fresh and self._decode_links_up()

        self.wait(links_up, timeout_s, "decode workers' links to prefill workers")

    def _decodes(self) -> dict[str, dict[str, Any]]:
        workers = self.workers().items()
        return {key: w for key, w in workers if w.get("role") == "decode" and w.get("up")}

    def settled(self, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
        """Every worker's stats once each of ``names`` has sent two heartbeats after this
        call (a worker's counters reach the gateway with its heartbeats, not with an
        answer)."""
        beats = {n: self.worker(n).get("heartbeats_total", 0) for n in names}
        workers: dict[str, dict[str, Any]] = {}

        def fresh() -> bool:
            nonlocal workers
            workers = self.workers()
            return all(workers.get(n, {}).get("heartbeats_total", 0) >= beats[n] + 2
                       for n in names)  # fmt: skip

        self.wait(fresh, 30, f"fresh heartbeats from {', '.join(names)}")
        return workers

    def wait_host_tier(self, timeout_s: float = 60.0) -> None:
        """Wait until every prefill and decode worker has attached to the kvstore's host
        tier (until then, evicted pages are dropped rather than spilled)."""

        def attached() -> bool:
            workers = [w for w in self.workers().values() if w.get("role") in WORKER_ROLES]
            return bool(workers) and all(w.get("up") and w.get("host_attached") for w in workers)

        self.wait(attached, timeout_s, "the workers to attach to the host tier")

    def stop(self) -> None:
        self.processes.stop()


def supervise(processes: ClusterProcesses) -> None:
    """One supervision pass of ``processes``, then their pools' reconciliation."""
    processes.supervisor.poll()
    if processes.pools is not None:
        processes.pools.reconcile()


def threads_described(config: ClusterConfig) -> str:
    """How the workers of ``config`` get their CPU threads, in words (for reports)."""
    if config.num_threads:
        return f"{config.num_threads} thread(s) each, fixed"
    return f"the {os.cpu_count() or 1} cores shared: each step on cores ÷ workers busy"


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` in a Prometheus text
    exposition (e.g. a /metrics body); 0 if there is none."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        head, _, value = line.rpartition(" ")
        metric, _, label_text = head.partition("{")
        if metric != name:
            continue
        if all(f'{k}="{v}"' in label_text for k, v in labels.items()):
            total += float(value)
    return total
