"""Secure by default, run as a user runs it (real subprocesses): a service bound beyond
loopback refuses to start without the cluster secret, the gateway (and `radixserve up`)
without API keys, and the example files' placeholders are refused, each naming the
setting to set."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.protocol.security import InsecureBindError, is_loopback
from radixserve.runtime.settings import ServiceSettings

CLI = [sys.executable, "-m", "radixserve.cli"]
SECRET = "a-secret-of-this-test-0123456789"
KEY = "a-key-of-this-test-0123456789"
ENV_EXAMPLE = Path(__file__).parents[2] / "compose" / ".env.example"


def run(*args: str, env: dict[str, str] | None = None, module: str | None = None):
    """The command with a clean RADIXSERVE_* environment plus ``env``."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    argv = [sys.executable, "-m", module] if module else [*CLI, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60,
                          env={**base, **(env or {})})  # fmt: skip


@pytest.mark.parametrize("service", ["kvstore", "prefill", "decode"])
def test_a_service_beyond_loopback_needs_the_secret(service: str) -> None:
    done = run(service, "--host", "0.0.0.0")  # refused before a worker loads its model
    assert done.returncode != 0 and "RADIXSERVE_CLUSTER_SECRET" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


def test_check_config_refuses_what_the_service_would() -> None:
    checked = run("kvstore", "--host", "0.0.0.0", "--check-config")
    assert checked.returncode != 0 and "RADIXSERVE_CLUSTER_SECRET" in checked.stderr
    ok = run("kvstore", "--host", "0.0.0.0", "--check-config",
             env={"RADIXSERVE_CLUSTER_SECRET": SECRET})  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert SECRET not in ok.stdout


def test_the_services_own_entry_point_refuses_too() -> None:
    """What `radixserve up` and a bare ``python -m`` run."""
    done = run(module="radixserve.services.kvstore", env={"RADIXSERVE_KVSTORE_HOST": "0.0.0.0"})
    assert done.returncode != 0 and "RADIXSERVE_CLUSTER_SECRET" in done.stderr, done.stderr


def test_the_example_secret_is_refused() -> None:
    [placeholder] = [line.split("=", 1)[1] for line in ENV_EXAMPLE.read_text().splitlines()
                     if line.startswith("RADIXSERVE_CLUSTER_SECRET=")]  # fmt: skip
    done = run("kvstore", "--check-config", env={"RADIXSERVE_CLUSTER_SECRET": placeholder})
    assert done.returncode == 2 and "placeholder" in done.stderr, done.stderr
    assert "RADIXSERVE_CLUSTER_SECRET" in done.stderr and placeholder not in done.stderr


def test_up_beyond_loopback_needs_api_keys(tmp_path: Path) -> None:
    done = run("up", "--host", "0.0.0.0", "--port", "0")
    assert done.returncode != 0, done.stdout
    assert "RADIXSERVE_GATEWAY_API_KEYS" in done.stderr and "--allow-unauthenticated" in done.stderr
    assert "starting" not in done.stdout  # refused before any process started


def test_the_gateway_refuses_an_empty_key_and_an_open_bind() -> None:
    done = run("gateway", env={"RADIXSERVE_GATEWAY_API_KEYS": '[""]'})
    assert done.returncode == 2 and "at least 16 characters" in done.stderr, done.stderr
    done = run("gateway", env={"RADIXSERVE_GATEWAY_HOST": "0.0.0.0"})
    assert done.returncode == 1 and "RADIXSERVE_GATEWAY_API_KEYS" in done.stderr, done.stderr
    for extra in (["--allow-unauthenticated"], []):
        env = {"RADIXSERVE_GATEWAY_HOST": "0.0.0.0"}
        if not extra:
            env["RADIXSERVE_GATEWAY_API_KEYS"] = f'["{KEY}"]'
        checked = run("gateway", "--check-config", *extra, env=env)
        assert checked.returncode == 0, checked.stderr
        assert KEY not in checked.stdout


def test_loopback_is_what_reaches_this_machine_only() -> None:
    assert all(map(is_loopback, ("127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "kvstore", "pod.local")))
    ServiceSettings(host="127.0.0.1").require_secure("kvstore")
    with pytest.raises(InsecureBindError, match=r"10\.1\.2\.3 \(transfer_host\)"):
        ServiceSettings(transfer_host="10.1.2.3").require_secure("decode")
    ServiceSettings(host="0.0.0.0", cluster_secret=SECRET).require_secure("decode")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"kvstores": ["tcp://a:1", "tcp://b:1"]}, "needs RADIXSERVE_DECODE_KVSTORE"),
        ({"kvstore": "tcp://c:1", "kvstores": ["tcp://a:1", "tcp://b:1"]}, "is not among"),
        ({"kvstore": "tcp://a:1", "kvstores": ["tcp://a:1", "tcp://a:1"]}, "twice"),
    ],
)
def test_a_worker_refuses_a_kvstore_list_without_its_own_node(fields, expected) -> None:
    """One kvstore per node: the list names each once, this node's among them (the CLI
    prints such a message: `test_up_refuses_nodes_without_the_kvstore` runs it)."""
    from pydantic import ValidationError

    from radixserve.services.decode import DecodeSettings

    with pytest.raises(ValidationError, match=expected):
        DecodeSettings(**fields)
    ok = DecodeSettings(kvstore="tcp://b:1", kvstores=["tcp://a:1", "tcp://b:1"])
    assert ok.index_shards == ["tcp://a:1", "tcp://b:1"]


def test_up_refuses_nodes_without_the_kvstore() -> None:
    result = run("up", "--nodes", "2", "--no-kvstore")
    assert result.returncode != 0
    assert "--nodes needs the kvstore" in result.stderr


def test_a_setting_error_across_settings_reads_as_its_message() -> None:
    """The CLI's line for a validation error: the setting's name when it has one, never
    pydantic's "Value error, " prefix or an empty name."""
    from radixserve.cli import _problem

    assert _problem({"loc": (), "msg": "Value error, A needs B"}) == "A needs B"
    assert _problem({"loc": ("port",), "msg": "Input should be ..."}) == "port: Input should be ..."
