"""Model identity through real processes (what ``radixserve up`` starts): a prefill
worker loaded with other weights than its decode worker (two tiny random-init
checkpoints of one shape and tokenizer) is refused at the handshake, by the decode
worker and by the gateway, with a message naming both identities; the decode worker
serves alone, and /v1/models shows the identity of the weights it loaded."""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.bench.local_cluster import supervise
from radixserve.launch.cluster import ClusterConfig, build_cluster, gateway_healthy
from radixserve.model.identity import weights_fingerprint
from tests.cluster.cluster_helpers import FAST_LIVENESS
from tests.model.tiny_checkpoints import write_tiny_checkpoint


def _env(prefix: str, values: dict[str, str]) -> dict[str, str]:
    return {f"RADIXSERVE_{prefix}_{k}": v for k, v in values.items()}


def _debug_cache(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/debug/cache", timeout=10) as resp:
        body: dict[str, Any] = json.load(resp)
    return body


def test_a_prefill_worker_with_other_weights_is_refused_naming_both(
    tmp_path: Path, capfd: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))  # the workers' too
    decode_model = write_tiny_checkpoint(tmp_path / "decode-weights", seed=1)
    prefill_model = write_tiny_checkpoint(tmp_path / "prefill-weights", seed=2)
    ours = weights_fingerprint(decode_model)[len("sha256:") :][:12]
    theirs = weights_fingerprint(prefill_model)[len("sha256:") :][:12]
    assert ours != theirs
    config = ClusterConfig(
        kvstore=False,  # the workers link by address: the handshake under test is theirs
        transport="zmq",
        num_threads=1,
        port=0,  # any free port, bound by `build_cluster`
        engine_env={
            "RADIXSERVE_DEVICE": "cpu",
            "RADIXSERVE_MODEL": str(decode_model),
            "RADIXSERVE_KV_CACHE_MEMORY_GIB": "0.05",
        },  # fmt: skip
        prefill_env={"RADIXSERVE_MODEL": str(prefill_model), **_env("PREFILL", FAST_LIVENESS)},
        decode_env=_env("DECODE", FAST_LIVENESS),
        gateway_env=_env("GATEWAY", FAST_LIVENESS),
    )
    # not a `LocalCluster`: that waits for every worker to be up at the gateway
    processes = build_cluster(config, restart_backoff_s=0.2)
    url = processes.url  # the gateway's, on the port bound

    def wait(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not condition():
            supervise(processes)
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.1)

    try:
        processes.supervisor.start()
        wait(lambda: gateway_healthy(url), 180, "the gateway healthy")

        def prefill_entry() -> dict[str, Any]:
            workers = _debug_cache(url)["workers"]
            [entry] = [w for w in workers.values() if w["role"] == "prefill"]
            return entry  # under its address while it was never up here

        wait(lambda: "refused" in (prefill_entry().get("model_identity") or {}), 60,
             "the gateway to refuse the prefill worker")  # fmt: skip
        wait(lambda: "prefills_up" in _debug_cache(url)["workers"]["decode-0"], 30,
             "a heartbeat of the decode worker")  # fmt: skip
        decode, prefill = _debug_cache(url)["workers"]["decode-0"], prefill_entry()
        assert decode["up"] and not prefill["up"]
        assert decode["model_identity"]["short"].startswith(ours)
        refusal = prefill["model_identity"]["refused"]
        assert "model identity" in refusal and ours in refusal and theirs in refusal
        assert decode["prefills_up"] == 0  # the decode worker refused it too
        with httpx.Client(base_url=url, timeout=120) as http:
            [card] = http.get("/v1/models").json()["data"]
            assert card["identity"] == decode["model_identity"]
            assert card["identity"]["weights"] == weights_fingerprint(decode_model)
            body = {"model": card["id"], "prompt": "hello", "max_tokens": 4, "temperature": 0}
            assert http.post("/v1/completions", json=body).status_code == 200  # served alone
    finally:
        processes.stop()
    logs = capfd.readouterr().err
    [line] = {line for line in logs.splitlines() if "refusing worker prefill-0" in line
              and "decode-0 cannot share" in line}  # fmt: skip
    assert "model identity" in line and ours in line and theirs in line
