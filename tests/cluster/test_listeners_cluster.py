"""Clusters of 2 prefill and 2 decode workers with the autoscaler, started two at a time
twenty times, every port any free one: each comes up with no process restarted and
nothing reporting an address in use (each service serves on the socket its supervisor
bound for it, `radixserve.launch.listeners`)."""

from __future__ import annotations

import time

import httpx
import pytest

from radixserve.bench.local_cluster import supervise
from radixserve.launch.cluster import (
    ClusterConfig,
    ClusterProcesses,
    build_cluster,
    gateway_healthy,
)
from tests.cluster.cluster_helpers import FAST_LIVENESS

ROUNDS, AT_ONCE = 10, 2


def _env(prefix: str, values: dict[str, str]) -> dict[str, str]:
    return {f"RADIXSERVE_{prefix}_{k}": v for k, v in values.items()}


def _config(model: str) -> ClusterConfig:
    return ClusterConfig(
        num_prefill=2,
        num_decode=2,
        transport="zmq",
        num_threads=1,
        port=0,
        engine_env={"RADIXSERVE_MODEL": model, "RADIXSERVE_DEVICE": "cpu",
                    "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.05",
                    **_env("KVSTORE", {**FAST_LIVENESS, "HOST_CAPACITY_GIB": "0.05"})},
        prefill_env=_env("PREFILL", FAST_LIVENESS),
        decode_env=_env("DECODE", FAST_LIVENESS),
        gateway_env=_env("GATEWAY", FAST_LIVENESS),
        autoscale=True,
        # the autoscaler on any free port too; it only watches here
        autoscaler_env=_env("AUTOSCALER", {"PORT": "0", "INTERVAL_S": "60"}),
    )  # fmt: skip


def _up(cluster: ClusterProcesses) -> bool:
    """The gateway healthy with all four workers up, and the autoscaler answering."""
    if not gateway_healthy(cluster.url):
        return False
    workers = httpx.get(f"{cluster.url}/debug/cache", timeout=10).json()["workers"]
    up = [w for w in workers.values() if w.get("role") in ("prefill", "decode") and w["up"]]
    scaler = httpx.get(f"{cluster.autoscaler_url}/live", timeout=10)
    return len(up) == 4 and scaler.status_code == 200


@pytest.mark.benchmark
@pytest.mark.timeout(3600)
def test_clusters_started_two_at_a_time_never_share_a_port_nor_restart(tiny_model, capfd):
    for round_ in range(ROUNDS):
        clusters = [build_cluster(_config(tiny_model), restart_backoff_s=0.2)
                    for _ in range(AT_ONCE)]  # fmt: skip
        try:
            for cluster in clusters:
                cluster.supervisor.start()
            deadline = time.monotonic() + 300
            while not all(_up(c) for c in clusters):
                for cluster in clusters:
                    supervise(cluster)
                assert time.monotonic() < deadline, f"round {round_}: clusters not up"
                time.sleep(0.2)
            for cluster in clusters:
                supervise(cluster)
                assert all(n == 0 for n in cluster.supervisor.restarts.values()), (
                    round_, cluster.supervisor.restarts)  # fmt: skip
        finally:
            for cluster in clusters:
                cluster.stop()
        out = capfd.readouterr()
        assert "already in use" not in (out.out + out.err).lower(), f"round {round_}"
