"""`--trace-buffer N` on `radixserve up` sets the gateway's trace buffer (as on `serve`);
a bad value is refused by name before any process starts."""

from __future__ import annotations

from radixserve.cli import main
from radixserve.launch.cluster import ClusterConfig, cluster_specs
from radixserve.services.gateway import GatewaySettings
from tests.launch.test_cluster import _settings_of


class _NoCluster:
    """Stands in for `build_cluster`: keeps the configuration `up` built, then stops
    `up` (as Ctrl-C would) before any process starts."""

    def __init__(self) -> None:
        self.configs: list[ClusterConfig] = []

    def __call__(self, config: ClusterConfig, control_port: int = 0) -> None:
        self.configs.append(config)
        raise KeyboardInterrupt


def test_up_passes_the_trace_buffer_to_the_gateway(monkeypatch, capsys):
    built = _NoCluster()
    monkeypatch.setattr("radixserve.launch.cluster.build_cluster", built)
    assert main(["up", "--trace-buffer", "0"]) == 130
    envs = {s.name: dict(s.env) for s in cluster_specs(built.configs[0])}
    assert _settings_of(envs["gateway"], GatewaySettings, monkeypatch).trace_buffer == 0
    assert main(["up", "--trace-buffer", "-1"]) == 2
    assert "trace_buffer" in capsys.readouterr().err
    assert main(["serve", "--trace-buffer", "70000"]) == 2
    assert "trace_buffer" in capsys.readouterr().err
    assert len(built.configs) == 1
