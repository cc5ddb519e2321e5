"""``radixserve <service> --check-config``: the settings a service would start with, and a
refusal naming any RADIXSERVE_* variable the service does not read."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from radixserve.cli import main
from radixserve.runtime.settings import resolved_tp
from radixserve.runtime.settings_check import (
    UnknownSettingError,
    check_config,
    variable_names,
)
from radixserve.settings import EngineSettings

SERVICES = ("kvstore", "prefill", "decode", "gateway", "autoscaler")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("RADIXSERVE_")]:
        monkeypatch.delenv(key)


@pytest.mark.parametrize("service", SERVICES)
def test_each_service_reports_its_settings(service: str) -> None:
    settings = check_config(service, {})
    assert "ProbeSettings" in settings
    assert ("EngineSettings" in settings) == (service in ("prefill", "decode", "gateway"))


def test_environment_and_flags_are_what_the_service_would_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS", "512")
    monkeypatch.setenv("RADIXSERVE_PAGE_SIZE", "32")
    monkeypatch.setenv("RADIXSERVE_CLUSTER_SECRET", "a-secret-that-is-long-enough-0123")
    settings = check_config("decode", {"port": 7123})
    assert settings["DecodeSettings"]["local_prefill_max_tokens"] == 512
    assert settings["DecodeSettings"]["port"] == 7123
    assert settings["EngineSettings"]["page_size"] == 32
    assert "a-secret" not in json.dumps(settings)  # never printed


def test_a_misspelt_variable_is_refused_with_the_close_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("RADIXSERVE_DECODE_LOCAL_PREFIL_MAX_TOKENS", "3")
    with pytest.raises(
        UnknownSettingError, match="did you mean RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS"
    ):
        check_config("decode", {})
    # another service's variable is let through (one ConfigMap often serves them all)
    monkeypatch.delenv("RADIXSERVE_DECODE_LOCAL_PREFIL_MAX_TOKENS")
    monkeypatch.setenv("RADIXSERVE_GATEWAY_PORT", "8000")
    assert "KVStoreSettings" in check_config("kvstore", {})


def test_a_refused_value_is_pydantics_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_KVSTORE_PORT", "not-a-port")
    with pytest.raises(ValidationError):
        check_config("kvstore", {})


def test_variable_names_follow_the_prefix() -> None:
    names = variable_names(EngineSettings)
    assert {"RADIXSERVE_MODEL", "RADIXSERVE_PAGE_SIZE"} <= names


def test_the_cli_exit_codes(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["kvstore", "--check-config", "--port", "7001"]) == 0
    assert json.loads(capsys.readouterr().out)["KVStoreSettings"]["port"] == 7001
    monkeypatch.setenv("RADIXSERVE_KVSTORE_PORTT", "1")
    assert main(["kvstore", "--check-config"]) == 1
    assert "did you mean RADIXSERVE_KVSTORE_PORT" in capsys.readouterr().err
    monkeypatch.delenv("RADIXSERVE_KVSTORE_PORTT")
    monkeypatch.setenv("RADIXSERVE_KVSTORE_PORT", "x")
    assert main(["kvstore", "--check-config"]) == 2
    assert "invalid setting" in capsys.readouterr().err


def test_a_workers_tp_is_a_size_or_auto(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`auto` (the compose GPU override's) is one rank per CUDA device the worker sees:
    1 on this machine (no CUDA); the engine is shown the size it resolves to."""
    monkeypatch.setenv("RADIXSERVE_PREFILL_TP", "auto")
    settings = check_config("prefill", {})
    assert settings["PrefillSettings"]["tp"] == "auto" and resolved_tp("auto") == 1
    assert check_config("decode", {"tp": "auto"})["EngineSettings"]["tp"] == 1
    assert check_config("decode", {"tp": 3})["DecodeSettings"]["tp"] == 3
    for refused in ("0", "65", "two", "1.5"):
        monkeypatch.setenv("RADIXSERVE_PREFILL_TP", refused)
        with pytest.raises(ValidationError, match="not a tensor-parallel size from 1 to 64"):
            check_config("prefill", {})
    with pytest.raises(SystemExit):
        main(["decode", "--tp", "0"])
    assert "--tp: '0' is not a tensor-parallel size" in capsys.readouterr().err


def test_api_keys_print_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    key = "a-key-never-printed-0123456789"
    monkeypatch.setenv(
        "RADIXSERVE_GATEWAY_API_KEYS", json.dumps([key, {"key": key + "-admin", "role": "admin"}])
    )
    printed = json.dumps(check_config("gateway", {}))
    assert key not in printed
    listed = check_config("gateway", {})["GatewaySettings"]["api_keys"]
    assert [entry["role"] for entry in listed] == ["user", "admin"]
    assert {entry["key"] for entry in listed} == {"**********"}
    # what the gateway would refuse at start is refused here too
    monkeypatch.setenv("RADIXSERVE_GATEWAY_API_KEYS", "[]")
    with pytest.raises(ValueError, match="RADIXSERVE_GATEWAY_API_KEYS"):
        check_config("gateway", {"host": "0.0.0.0"})
