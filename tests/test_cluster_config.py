"""`radixserve up`'s process specs: every service configured through its own settings."""

from __future__ import annotations

import json

import pytest

from radixserve.cluster import ClusterConfig, cluster_specs
from radixserve.services.decode import DecodeSettings
from radixserve.services.gateway import GatewaySettings
from radixserve.services.kvstore import KVStoreSettings
from radixserve.services.prefill import PrefillSettings


def test_specs_wire_workers_to_each_other_and_the_gateway(monkeypatch):
    config = ClusterConfig(num_prefill=2, num_decode=3, transport="zmq", port=8123,
                           engine_env={"RADIXSERVE_PREFIX_CACHE": "false"}, num_threads=2)  # fmt: skip
    specs = cluster_specs(config)
    assert [s.name for s in specs] == [
        "kvstore", "prefill-0", "prefill-1", "decode-0", "decode-1", "decode-2", "gateway",
    ]  # fmt: skip
    envs = {s.name: dict(s.env) for s in specs}
    kvstore = envs["gateway"]["RADIXSERVE_GATEWAY_KVSTORE"]
    prefill_addrs = [f"tcp://127.0.0.1:{envs[f'prefill-{i}']['RADIXSERVE_PREFILL_PORT']}"
                     for i in range(2)]  # fmt: skip
    # each service's env parses into its own settings class, as in a real deployment
    for name, env in envs.items():
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        assert env["RADIXSERVE_PREFIX_CACHE"] == "false" and env["RADIXSERVE_NUM_THREADS"] == "2"
        if name.startswith("prefill"):
            s = PrefillSettings()
            assert s.name == name and s.transfer_backend == "zmq" and s.kvstore == kvstore
        elif name.startswith("decode"):
            s = DecodeSettings()
            assert s.name == name and s.prefill_workers == prefill_addrs
            assert s.kvstore == kvstore
        elif name == "kvstore":
            assert f"tcp://127.0.0.1:{KVStoreSettings().port}" == kvstore
        else:
            g = GatewaySettings()
            assert g.port == 8123 and g.prefill_workers == prefill_addrs
            assert len(g.decode_workers) == 3 and g.kvstore == kvstore
        for key in env:
            monkeypatch.delenv(key)
    ports = [
        int(a.rsplit(":", 1)[1])
        for a in json.loads(envs["gateway"]["RADIXSERVE_GATEWAY_DECODE_WORKERS"])
    ]
    assert len(set(ports)) == 3


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_decode": 0}, "at least one decode worker"),
        ({"num_prefill": -1}, "--prefill"),
        ({"transport": "tcp"}, "--transport"),
    ],
)
def test_bad_cluster_shapes_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ClusterConfig(**kwargs)


def test_no_kvstore_means_no_kvstore_settings_anywhere():
    specs = cluster_specs(ClusterConfig(kvstore=False))
    assert [s.name for s in specs] == ["prefill-0", "decode-0", "gateway"]
    assert not any(key.endswith("_KVSTORE") for s in specs for key in s.env)
