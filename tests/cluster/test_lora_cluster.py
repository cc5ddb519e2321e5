"""LoRA adapters through `radixserve up`'s processes (the tiny model; one prefill and one
decode worker, every prompt prefilled remotely; API keys), as a client sees them.

The workers start with ``lora_modules`` from the environment: "qv" on both, and "mix",
which names the "qv" content on the decode worker and the "all" content on the prefill
worker (two adapters under one name: the decode worker must not read pages the prefill
worker computes with its own). Adapters are made with ``peft`` here (`lora_helpers`);
the answers are compared with one engine's in this process, with the same adapters.

- an adapter's greedy answer through the gateway and a remote prefill equals the single
  engine's, and differs from the base model's; /v1/models lists it under the base model;
  an unknown name is a 404 naming it;
- its second request reads the prompt from the cache, another adapter's reads nothing;
- "mix" is never prefilled on the prefill worker (its adapter there is another): the
  decode worker computes it, and the answer is its own adapter's;
- an admin loads "all" at run time on every worker, a request uses it (remotely
  prefilled), an unload while a stream uses it is refused, one when idle is done; a
  path outside the adapter directory and a user key are refused.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.engine.engine import Engine
from radixserve.settings import EngineSettings
from tests.cluster.cluster_helpers import TestCluster
from tests.gateway.conftest import assert_openai_error
from tests.gateway.lora_helpers import greedy_text, write_adapters

pytest.importorskip("peft")

NEW_TOKENS = 8
PROMPT = list(range(50, 50 + 45))  # two full pages of 16 and a partial one
USER = "lora-user-key-0123456789"
ADMIN = "lora-admin-key-0123456789"


@dataclass
class Served:
    cluster: TestCluster
    lora_dir: Path
    refs: dict[str, str]  # adapter ("" = the base model) -> greedy text of PROMPT ("all-":
    # of PROMPT but its last token)


def _modules(**dirs: Path) -> str:
    return json.dumps([f"{name}={path}" for name, path in dirs.items()])


@pytest.fixture(scope="module")
def served(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    lora_dir = tmp_path_factory.mktemp("lora")
    dirs = write_adapters(Path(tiny_model), lora_dir, ("qv", "all"))
    write_adapters(Path(tiny_model), lora_dir.parent / "elsewhere", ("qv",))
    engine = Engine(EngineSettings(model=tiny_model, device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.05,
                                   lora_modules=tuple(f"{n}={p}" for n, p in dirs.items())))  # fmt: skip
    refs = {a: greedy_text(engine, PROMPT, a, NEW_TOKENS) for a in ("", "qv", "all")}
    refs["all-"] = greedy_text(engine, PROMPT[:-1], "all", NEW_TOKENS)  # (not cached anywhere)
    del engine
    keys = [{"key": USER, "tenant": "team", "role": "user"},
            {"key": ADMIN, "tenant": "ops", "role": "admin"}]  # fmt: skip
    cluster = TestCluster(
        transport="zmq",
        model=tiny_model,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},
        gateway={
            "API_KEYS": json.dumps(keys),
            "ALLOW_RUNTIME_LORA": "true",
            "LORA_DIR": str(lora_dir),
        },  # fmt: skip
        env={"RADIXSERVE_LORA_MODULES": _modules(qv=dirs["qv"], mix=dirs["qv"])},
        prefill_engine={"RADIXSERVE_LORA_MODULES": _modules(qv=dirs["qv"], mix=dirs["all"])},
    )
    try:
        yield Served(cluster, lora_dir, refs)
    finally:
        cluster.stop()


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(cluster: TestCluster, model: str, prompt: list[int] = PROMPT) -> dict[str, Any]:
    resp = _post(cluster, model, prompt)
    assert resp.status_code == 200, resp.text
    return resp.json()


def _post(cluster: TestCluster, model: str, prompt: list[int] = PROMPT) -> httpx.Response:
    body = {"model": model, "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0}
    return cluster.http.post("/v1/completions", json=body, headers=_auth(USER))


def _decode_counters(cluster: TestCluster) -> dict[str, int]:
    """The decode worker's prefill counters, as a heartbeat sent after now states them."""
    beats = cluster.worker("decode-0")["heartbeats_total"]
    cluster.wait(lambda: cluster.worker("decode-0")["heartbeats_total"] > beats + 1, 10,
                 "a heartbeat of the decode worker")  # fmt: skip
    decode = cluster.worker("decode-0")
    return {k: decode.get(k, 0) for k in ("remote_prefills_total", "local_prefills_total")}


def _admin(cluster: TestCluster, route: str, body: dict[str, str], key: str = ADMIN):
    return cluster.http.post(route, json=body, headers=_auth(key))


def test_an_adapters_answer_through_a_remote_prefill_equals_one_engines(served: Served) -> None:
    cluster, refs = served.cluster, served.refs
    assert refs["qv"] != refs[""] and refs["all"] != refs["qv"]
    before = _decode_counters(cluster)
    answer = _complete(cluster, "qv")
    assert answer["choices"][0]["text"] == refs["qv"] and answer["model"] == "qv"
    assert _complete(cluster, "default")["choices"][0]["text"] == refs[""]
    after = _decode_counters(cluster)
    assert after["remote_prefills_total"] == before["remote_prefills_total"] + 2


def test_models_lists_the_adapters_and_an_unknown_one_is_a_404(served: Served) -> None:
    cluster = served.cluster
    cards = {c["id"]: c for c in cluster.http.get("/v1/models", headers=_auth(USER)).json()["data"]}
    [base] = [c for c in cards.values() if c.get("parent") is None]
    assert cards["qv"]["parent"] == base["id"] and cards["mix"]["parent"] == base["id"]
    assert cards["qv"]["root"] == str((served.lora_dir / "qv").resolve())
    assert cards["mix"]["fingerprint"] == cards["qv"]["fingerprint"]  # the decode worker's
    listed = cluster.http.get("/debug/explorer/workers", headers=_auth(ADMIN)).json()["workers"]
    loras = {w["name"]: w.get("loras") for w in listed}  # the explorer's cards
    assert loras["decode-0"]["mix"] == loras["decode-0"]["qv"] == cards["qv"]["fingerprint"]
    assert loras["prefill-0"]["mix"] != cards["qv"]["fingerprint"] and loras["kvstore"] is None
    error = assert_openai_error(_post(cluster, "no-such-adapter"), 404)
    assert "no-such-adapter" in error["message"] and error["param"] == "model"


def test_cached_tokens_are_the_adapters_own(served: Served) -> None:
    cluster = served.cluster
    prompt = list(range(400, 400 + 40))
    first = _complete(cluster, "qv", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    again = _complete(cluster, "qv", prompt)["usage"]["prompt_tokens_details"]["cached_tokens"]
    other = _complete(cluster, "default", prompt)["usage"]["prompt_tokens_details"]
    assert first == 0 and again > 0 and other["cached_tokens"] == 0


def test_a_name_whose_content_differs_on_the_prefill_worker_is_computed_on_decode(
    served: Served,
) -> None:
    """ "mix" is the "qv" content on the decode worker and the "all" content on the prefill
    worker: it is never sent there; the decode worker computes it with its own adapter."""
    cluster = served.cluster
    before = _decode_counters(cluster)
    answer = _complete(cluster, "mix")
    assert answer["choices"][0]["text"] == served.refs["qv"]
    after = _decode_counters(cluster)
    assert after["remote_prefills_total"] == before["remote_prefills_total"]
    assert after["local_prefills_total"] == before["local_prefills_total"] + 1


def test_load_use_and_unload_at_run_time_on_every_worker(served: Served) -> None:
    cluster = served.cluster
    refused = _admin(cluster, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": "all"},
                     key=USER)  # fmt: skip
    assert "admin" in assert_openai_error(refused, 403)["message"]
    escape = _admin(cluster, "/v1/load_lora_adapter",
                    {"lora_name": "x", "lora_path": "../elsewhere/qv"})  # fmt: skip
    assert "../elsewhere/qv" in assert_openai_error(escape, 403)["message"]
    assert_openai_error(_post(cluster, "all"), 404)

    loaded = _admin(cluster, "/v1/load_lora_adapter", {"lora_name": "all", "lora_path": "all"})
    assert loaded.status_code == 200, loaded.text
    cluster.wait(lambda: all("all" in w.get("loras", {}) for w in _workers(cluster)), 10,
                 "every worker to state the adapter")  # fmt: skip
    before = _decode_counters(cluster)
    assert _complete(cluster, "all")["choices"][0]["text"] == served.refs["all"]
    assert _decode_counters(cluster)["remote_prefills_total"] == before["remote_prefills_total"] + 1

    # a prefill worker that restarts serves it again: the gateway loads it there anew
    old_generation = cluster.worker("prefill-0")["generation"]
    os.kill(cluster.supervisor.pid("prefill-0"), signal.SIGKILL)
    cluster.wait_restarted("prefill-0", old_generation)
    cluster.wait(lambda: "all" in cluster.worker("prefill-0").get("loras", {}), 30,
                 "the restarted prefill worker to serve the adapter")  # fmt: skip
    before = _decode_counters(cluster)
    assert _complete(cluster, "all", PROMPT[:-1])["choices"][0]["text"] == served.refs["all-"]
    assert _decode_counters(cluster)["remote_prefills_total"] == before["remote_prefills_total"] + 1

    started, release = threading.Event(), threading.Event()
    body = {"model": "all", "prompt": PROMPT, "max_tokens": 2000, "min_tokens": 2000,
            "temperature": 0, "stream": True}  # fmt: skip

    def stream() -> None:
        with (
            httpx.Client(base_url=cluster.url, timeout=60, headers=_auth(USER)) as client,
            client.stream("POST", "/v1/completions", json=body) as events,
        ):
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    release.wait(30)
                    break

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60)
        busy = _admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "all"})
        error = assert_openai_error(busy, 400)
        assert "in use" in error["message"] and "decode-0" in error["message"]
        assert 'running_lora_adapters="all"' in cluster.metrics()
    finally:
        release.set()
        reader.join(60)
    cluster.wait_clean()
    assert 'running_lora_adapters=""' in cluster.metrics()
    assert 'waiting_lora_adapters=""' in cluster.metrics()
    done = _admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "all"})
    assert done.status_code == 200, done.text
    assert_openai_error(_post(cluster, "all"), 404)
    gone = _admin(cluster, "/v1/unload_lora_adapter", {"lora_name": "all"})
    assert "all" in assert_openai_error(gone, 404)["message"]


def _workers(cluster: TestCluster) -> list[dict[str, Any]]:
    workers = cluster.http.get("/debug/cache", headers=_auth(ADMIN)).json()["workers"]
    return [w for w in workers.values() if w["role"] in ("prefill", "decode")]
