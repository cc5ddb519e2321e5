"""`radixserve up`'s process specs: every service configured through its own settings."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

from radixserve.cli import main
from radixserve.launch.cluster import (
    ClusterConfig,
    build_cluster,
    cluster_specs,
    join_command,
)
from radixserve.services.decode import DecodeSettings
from radixserve.services.gateway import GatewaySettings
from radixserve.services.kvstore import KVStoreSettings
from radixserve.services.prefill import PrefillSettings
from radixserve.settings import EngineSettings


def _settings_of(env: dict[str, str], cls, monkeypatch):
    """``cls`` built from ``env`` alone, as the service's process would build it."""
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    try:
        return cls()
    finally:
        for key in env:
            monkeypatch.delenv(key)


def test_with_the_kvstore_everyone_finds_the_workers_through_it(monkeypatch):
    config = ClusterConfig(num_prefill=2, num_decode=3, transport="zmq", port=8123,
                           engine_env={"RADIXSERVE_PREFIX_CACHE": "false"}, num_threads=2)  # fmt: skip
    specs = cluster_specs(config)
    assert [s.name for s in specs] == [
        "kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "gateway",
    ]  # fmt: skip
    envs = {s.name: dict(s.env) for s in specs}
    kvstore = envs["gateway"]["RADIXSERVE_GATEWAY_KVSTORE"]
    ports = set()
    # each service's env parses into its own settings class, as in a real deployment
    for name, env in envs.items():
        assert env["RADIXSERVE_PREFIX_CACHE"] == "false" and env["RADIXSERVE_NUM_THREADS"] == "2"
        if name.startswith("prefill"):
            s = _settings_of(env, PrefillSettings, monkeypatch)
            assert s.name == name and s.transfer_backend == "zmq" and s.kvstore == kvstore
            ports.add(s.port)
        elif name.startswith("decode"):
            s = _settings_of(env, DecodeSettings, monkeypatch)
            assert s.name == name and s.prefill_workers == [] and s.kvstore == kvstore
            ports.add(s.port)
        elif name == "kvstore":
            k = _settings_of(env, KVStoreSettings, monkeypatch)
            assert f"tcp://127.0.0.1:{k.port}" == kvstore
        else:
            g = _settings_of(env, GatewaySettings, monkeypatch)
            assert g.port == 8123 and g.kvstore == kvstore
            assert g.prefill_workers == [] and g.decode_workers == []  # all from membership
    assert len(ports) == 5


def test_without_the_kvstore_the_addresses_are_static_lists(monkeypatch):
    config = ClusterConfig(num_prefill=2, num_decode=2, kvstore=False)
    envs = {s.name: dict(s.env) for s in cluster_specs(config)}
    assert "kvstore" not in envs
    prefill_addrs = [f"tcp://127.0.0.1:{envs[f'prefill-{i}']['RADIXSERVE_PREFILL_PORT']}"
                     for i in range(2)]  # fmt: skip
    for i in range(2):
        s = _settings_of(envs[f"decode-{i}"], DecodeSettings, monkeypatch)
        assert s.prefill_workers == prefill_addrs and s.kvstore is None
    g = _settings_of(envs["gateway"], GatewaySettings, monkeypatch)
    assert g.prefill_workers == prefill_addrs and g.kvstore is None
    ports = [int(a.rsplit(":", 1)[1]) for a in g.decode_workers]
    assert len(set(ports)) == 2
    assert json.loads(envs["gateway"]["RADIXSERVE_GATEWAY_DECODE_WORKERS"]) == g.decode_workers


def test_join_command_carries_what_a_worker_must_share():
    config = ClusterConfig(transport="zmq", engine_env={"RADIXSERVE_PAGE_SIZE": "32"},
                           decode_env={"RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS": "64"})  # fmt: skip
    line = join_command(config, "tcp://127.0.0.1:5000", "decode")
    assert line.startswith("RADIXSERVE_PAGE_SIZE=32 RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS=64 ")
    assert line.endswith("decode --join tcp://127.0.0.1:5000 --transport zmq")
    assert "DECODE" not in join_command(config, "tcp://127.0.0.1:5000", "prefill")
    shared = ClusterConfig(core_board="/tmp/board")  # a worker joined on this host shares
    line = join_command(shared, "tcp://127.0.0.1:5000")
    assert f"RADIXSERVE_CORE_BOARD=/tmp/board RADIXSERVE_NUM_THREADS={os.cpu_count()} " in line


def test_each_pool_has_its_tensor_parallel_size_and_a_replica_is_a_worker(monkeypatch):
    """--prefill-tp / --decode-tp: every worker of the pool gets its pool's size (its own
    setting, which its process builds its engine with); the pools still count workers
    (replicas), whatever their ranks, and the threads per rank share the cores."""
    config = ClusterConfig(num_prefill=1, num_decode=2, prefill_tp=2, decode_tp=1)
    envs = {s.name: dict(s.env) for s in cluster_specs(config)}
    assert [n for n in envs if n.startswith(("prefill", "decode"))] == [
        "prefill-0", "decode-0", "decode-1"]  # fmt: skip
    assert _settings_of(envs["prefill-0"], PrefillSettings, monkeypatch).tp == 2
    assert _settings_of(envs["decode-0"], DecodeSettings, monkeypatch).tp is None
    assert envs["decode-0"]["RADIXSERVE_NUM_THREADS"] == str(max(1, (os.cpu_count() or 1) // 4))
    assert join_command(config, "tcp://127.0.0.1:5000").endswith("prefill --join "
                                                                 "tcp://127.0.0.1:5000 --tp 2")  # fmt: skip
    assert "--tp" not in join_command(config, "tcp://127.0.0.1:5000", "decode")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_decode": 0}, "at least one decode worker"),
        ({"decode_tp": 0}, "--prefill-tp and --decode-tp must be 1 or more"),
        ({"num_prefill": -1}, "--prefill"),
        ({"transport": "tcp"}, "--transport"),
        ({"autoscale": True, "kvstore": False}, "--autoscale needs the kvstore"),
        ({"disk_tier_gib": 8.0}, "--disk-tier-gib needs --disk-tier-dir"),
        ({"disk_tier_dir": "/d", "disk_tier_gib": 0.0}, "--disk-tier-gib must be more than 0"),
        ({"disk_tier_dir": "/d", "kvstore": False}, "--disk-tier-dir needs the kvstore"),
        ({"disk_tier_dir": "/d", "host_tier_gib": 0.0}, "--disk-tier-dir needs a host tier"),
    ],
)
def test_bad_cluster_shapes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_no_kvstore_means_no_kvstore_settings_anywhere():
    specs = cluster_specs(ClusterConfig(kvstore=False))
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "gateway"]
    assert not any(key.endswith("_KVSTORE") for s in specs for key in s.env)


def test_workers_share_the_cores_through_one_board_unless_threads_are_fixed(monkeypatch, tmp_path):
    """By default every worker may take all the cores and they share them through one
    core board (made by `build_cluster`, removed when the cluster stops); --num-threads N
    fixes N and no board."""
    cores = str(os.cpu_count() or 1)
    board = str(tmp_path / "cores")
    specs = cluster_specs(ClusterConfig(num_prefill=1, num_decode=2, core_board=board))
    workers = [s for s in specs if s.name.split("-")[0] in ("prefill", "decode")]
    assert len(workers) == 3
    for spec in workers:
        assert spec.env["RADIXSERVE_NUM_THREADS"] == spec.env["OMP_NUM_THREADS"] == cores
        engine = _settings_of(dict(spec.env), EngineSettings, monkeypatch)
        assert engine.core_board == board and engine.num_threads == int(cores)
    fixed = cluster_specs(ClusterConfig(num_threads=1))
    assert not any("RADIXSERVE_CORE_BOARD" in s.env for s in fixed)
    assert all(s.env["RADIXSERVE_NUM_THREADS"] == "1" for s in fixed)

    cluster = build_cluster(ClusterConfig(port=0))
    try:
        assert cluster.core_board and os.path.dirname(cluster.core_board) == tempfile.gettempdir()
        with open(cluster.core_board, "wb"):  # as the first worker's engine would make it
            pass
    finally:
        cluster.stop()
    assert not os.path.exists(cluster.core_board)
    fixed_threads = build_cluster(ClusterConfig(kvstore=False, num_threads=2, port=0))
    fixed_threads.stop()
    assert fixed_threads.core_board is None


def test_the_disk_tier_flags_reach_the_kvstore_settings(monkeypatch, tmp_path, capsys):
    """`radixserve up --disk-tier-dir D --disk-tier-gib N` sets the kvstore's disk tier
    (and nothing else's); `radixserve kvstore` takes the same flags; a refused shape is
    an error message naming the flag, not a traceback."""
    config = ClusterConfig(disk_tier_dir=str(tmp_path), disk_tier_gib=2.5)
    envs = {s.name: dict(s.env) for s in cluster_specs(config)}
    k = _settings_of(envs["kvstore"], KVStoreSettings, monkeypatch)
    assert (k.disk_tier_dir, k.disk_tier_gib) == (tmp_path, 2.5)
    assert not any("DISK_TIER" in key for name, env in envs.items() if name != "kvstore"
                   for key in env)  # fmt: skip
    assert main(["kvstore", "--check-config", "--disk-tier-dir", str(tmp_path),
                 "--disk-tier-gib", "3"]) == 0  # fmt: skip
    checked = json.loads(capsys.readouterr().out)["KVStoreSettings"]
    assert (checked["disk_tier_dir"], checked["disk_tier_gib"]) == (str(tmp_path), 3.0)
    assert main(["up", "--disk-tier-gib", "3"]) == 1
    assert "error: --disk-tier-gib needs --disk-tier-dir" in capsys.readouterr().err


def test_up_passes_the_response_store_flags_to_the_gateway(monkeypatch, capsys):
    """`radixserve up --response-store-size N --response-store-ttl-s S` sets the gateway's
    store bounds as `serve`'s flags do; a bad bound is refused by name before any process
    starts."""
    seen: list[ClusterConfig] = []

    def no_cluster(config: ClusterConfig, control_port: int = 0) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # stop `up` before it starts a process

    monkeypatch.setattr("radixserve.launch.cluster.build_cluster", no_cluster)
    assert main(["up", "--response-store-size", "7", "--response-store-ttl-s", "90"]) == 130
    envs = {s.name: dict(s.env) for s in cluster_specs(seen[0])}
    gateway = _settings_of(envs["gateway"], GatewaySettings, monkeypatch)
    assert (gateway.response_store_size, gateway.response_store_ttl_s) == (7, 90.0)
    assert main(["up", "--response-store-size", "-1"]) == 2
    assert "response_store_size" in capsys.readouterr().err
    assert len(seen) == 1


def test_up_passes_the_explorer_flag_and_the_autoscalers_address_to_the_gateway(monkeypatch):
    """`radixserve up --explorer-prompt-text --autoscale` lets the gateway's /explorer show
    prompt text and read the autoscaler's decisions at its HTTP port; without them the
    explorer shows token counts only and no autoscaler."""
    seen: list[ClusterConfig] = []

    def no_cluster(config: ClusterConfig, control_port: int = 0) -> None:
        seen.append(config)
        raise KeyboardInterrupt  # stop `up` before it starts a process

    monkeypatch.setattr("radixserve.launch.cluster.build_cluster", no_cluster)
    assert main(["up", "--explorer-prompt-text", "--autoscale"]) == 130
    assert main(["up"]) == 130
    gateways = [_settings_of({s.name: dict(s.env) for s in cluster_specs(config)}["gateway"],
                             GatewaySettings, monkeypatch) for config in seen]  # fmt: skip
    assert (
        gateways[0].explorer_prompt_text and gateways[0].autoscaler_url == "http://127.0.0.1:8090"
    )
    assert not gateways[1].explorer_prompt_text and gateways[1].autoscaler_url is None
