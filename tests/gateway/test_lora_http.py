"""LoRA adapters through the gateway's HTTP API on one engine (`radixserve serve`'s shape):
a request's ``model`` names the adapter on every generation route, /v1/models lists it
under the base model, an unknown name is a 404 naming it, and vLLM's run-time load and
unload routes (admin only, off unless allowed, paths confined to ``lora_dir``).

The tiny random model and adapters made with ``peft`` here (`lora_helpers`); the
references are the same engine's greedy tokens with the adapter, run before the server
starts, in a cache scope of their own (so they leave no page the requests could hit).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import write_tiny_model
from tests.gateway.conftest import RunningServer, assert_openai_error, wait_idle
from tests.gateway.lora_helpers import greedy_text, write_adapters

pytest.importorskip("peft")

NEW_TOKENS = 8
PROMPT = list(range(40, 40 + 37))  # two full pages of 16 and a partial one
CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]
ADMIN_KEY = "admin-key-0123456789"
USER_KEY = "user-key-0123456789ab"


@dataclass
class Served:
    engine: Engine
    client: LocalEngineClient
    lora_dir: Path
    outside: Path  # an adapter directory outside lora_dir
    refs: dict[tuple[str, str], str]  # (prompt kind, adapter) -> greedy text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("lora")
    model = write_tiny_model(root / "model")
    lora_dir = root / "adapters"
    dirs = write_adapters(model, lora_dir, ("qv", "all", "wide"))
    outside = write_adapters(model, root / "elsewhere", ("qv",))["qv"]
    (lora_dir / "escape").symlink_to(outside)  # a link inside that leads outside
    settings = EngineSettings(model=str(model), device="cpu", load_progress=False,
                              kv_cache_memory_gib=0.05, lora_modules=(f"qv={dirs['qv']}",))  # fmt: skip
    engine = Engine(settings)
    engine.load_lora("all", str(dirs["all"]))  # for its references; unloaded below
    chat = engine.tokenizer.encode_chat(CHAT)
    refs = {(kind, a): greedy_text(engine, p, a, NEW_TOKENS)
            for kind, p in (("completion", PROMPT), ("chat", chat)) for a in ("", "qv", "all")}  # fmt: skip
    engine.unload_lora("all")
    client = LocalEngineClient(AsyncEngine(engine))
    yield Served(engine, client, lora_dir, outside, refs)
    client.close()


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    """A gateway that loads adapters at run time from ``lora_dir`` (no API keys)."""
    settings = GatewaySettings(allow_runtime_lora=True, lora_dir=served.lora_dir)
    server = RunningServer(create_app(served.client, settings))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


def _complete(http: httpx.Client, model: str, prompt: list[int] = PROMPT) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": prompt,
                                              "max_tokens": NEW_TOKENS, "temperature": 0})  # fmt: skip


def _chat(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "messages": CHAT,
                                                   "max_tokens": NEW_TOKENS, "temperature": 0})  # fmt: skip


def test_the_model_field_selects_the_adapter_on_every_route(served: Served, http) -> None:
    """An adapter's greedy answer on /v1/completions, /v1/chat/completions, /v1/responses
    and /v1/messages equals the engine's with that adapter (and differs from the base
    model's); each response names the adapter as its model."""
    refs = served.refs
    assert refs[("completion", "qv")] != refs[("completion", "")]
    assert refs[("chat", "qv")] != refs[("chat", "")]
    for model, adapter in (("qv", "qv"), ("default", "")):
        completion = _complete(http, model)
        assert completion.status_code == 200, completion.text
        assert completion.json()["choices"][0]["text"] == refs[("completion", adapter)]
        assert completion.json()["model"] == (model if adapter else completion.json()["model"])
        chat = _chat(http, model)
        assert chat.status_code == 200, chat.text
        assert chat.json()["choices"][0]["message"]["content"] == refs[("chat", adapter)]
    assert completion.json()["model"] != "qv"  # the base model's id, for "default"
    response = http.post("/v1/responses", json={"model": "qv", "input": CHAT,
                                                "max_output_tokens": NEW_TOKENS, "temperature": 0})  # fmt: skip
    assert response.status_code == 200, response.text
    assert response.json()["model"] == "qv"
    assert response.json()["output"][-1]["content"][0]["text"] == refs[("chat", "qv")]
    message = http.post("/v1/messages", json={"model": "qv", "messages": CHAT,
                                              "max_tokens": NEW_TOKENS, "temperature": 0})  # fmt: skip
    assert message.status_code == 200, message.text
    assert message.json()["model"] == "qv"
    assert message.json()["content"][0]["text"] == refs[("chat", "qv")]


def test_models_lists_each_adapter_under_the_base_model(served: Served, http) -> None:
    cards = {card["id"]: card for card in http.get("/v1/models").json()["data"]}
    base = [card for card in cards.values() if "parent" not in card or card["parent"] is None]
    assert len(base) == 1
    qv = cards["qv"]
    assert qv["object"] == "model" and qv["parent"] == base[0]["id"]
    assert qv["root"] == str((served.lora_dir / "qv").resolve())
    assert qv["fingerprint"] == served.engine.loras.adapter("qv").fingerprint
    assert "all" not in cards  # not loaded
    [engine] = http.get("/debug/explorer/workers").json()["workers"]  # the explorer's card
    assert engine["loras"] == {"qv": qv["fingerprint"]}


def test_an_unknown_model_is_a_404_naming_it(http) -> None:
    for resp in (_complete(http, "no-such-adapter"), _chat(http, "no-such-adapter"),
                 http.post("/v1/responses", json={"model": "no-such-adapter", "input": "hi"})):  # fmt: skip
        error = assert_openai_error(resp, 404)
        assert "no-such-adapter" in error["message"] and error["param"] == "model"
    message = http.post("/v1/messages", json={"model": "no-such-adapter", "messages": CHAT,
                                              "max_tokens": 4})  # fmt: skip
    assert message.status_code == 404 and "no-such-adapter" in message.text


def test_cached_tokens_are_the_adapters_own(http) -> None:
    """The same prompt again with the same adapter reads its pages from the cache; with
    another adapter, or the base model, nothing (each adapter's pages are its own)."""
    prompt = list(range(300, 300 + 40))
    cached = []
    before = _adapter_counts(http, "qv")
    for model in ("qv", "qv", "default"):
        resp = _complete(http, model, prompt)
        assert resp.status_code == 200, resp.text
        cached.append(resp.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] == 0 and cached[1] == 32 and cached[2] == 0
    # the per-adapter counters: the two "qv" requests, not the base model's
    after = _adapter_counts(http, "qv")
    assert after["requests"] - before["requests"] == 2
    assert after["prompt_tokens"] - before["prompt_tokens"] == 80
    assert after["cached_tokens"] - before["cached_tokens"] == 32
    assert after["generation_tokens"] > before["generation_tokens"]


def _adapter_counts(http, adapter: str) -> dict[str, float]:
    """The gateway's radixserve_lora_*_total counters of ``adapter`` (0 before any)."""
    counts = dict.fromkeys(("requests", "prompt_tokens", "cached_tokens", "generation_tokens"), 0.0)
    for line in http.get("/metrics").text.splitlines():
        for what in counts:
            if line.startswith(f'radixserve_lora_{what}_total{{adapter="{adapter}"}}'):
                counts[what] = float(line.rsplit(" ", 1)[1])
    return counts


def test_load_use_and_unload_at_run_time(served: Served, http) -> None:
    """A loaded adapter answers as the engine does with it, shows in /v1/models, is
    refused (400, the engine's sentence) while a stream uses it, and unloads when idle;
    after that it is a 404, and unloading it again too."""
    resp = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": "all"})
    assert resp.status_code == 200, resp.text
    assert "all" in {card["id"] for card in http.get("/v1/models").json()["data"]}
    answer = _complete(http, "all")
    assert answer.status_code == 200 and answer.json()["model"] == "all"
    assert answer.json()["choices"][0]["text"] == served.refs[("completion", "all")]
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "all", "lora_path": "all"})
    assert "already" in assert_openai_error(again, 400)["message"]

    started, release = threading.Event(), threading.Event()
    body = {"model": "all", "prompt": PROMPT, "max_tokens": 2000, "min_tokens": 2000,
            "temperature": 0, "stream": True}  # fmt: skip

    def stream() -> None:
        with http.stream("POST", "/v1/completions", json=body) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    started.set()
                    if release.wait(0):
                        break
                    release.wait(30)
                    break

    reader = threading.Thread(target=stream)
    reader.start()
    try:
        assert started.wait(60)
        busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
        assert "in use" in assert_openai_error(busy, 400)["message"]
        text = http.get("/metrics").text
        assert 'running_lora_adapters="all"' in text
        # max_lora: the in-process engine's adapter slots
        assert f'max_lora="{served.engine.settings.max_loras}"' in text
    finally:
        release.set()
        reader.join(60)
    wait_idle(http)
    done = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert done.status_code == 200, done.text
    assert_openai_error(_complete(http, "all"), 404)
    gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "all"})
    assert "all" in assert_openai_error(gone, 404)["message"]


def test_paths_outside_the_adapter_directory_are_refused(served: Served, http) -> None:
    """Escapes by "..", by an absolute path and by a symbolic link are 403s naming the
    path; a path that is no directory is a 400; nothing was loaded."""
    for path in ("../elsewhere/qv", str(served.outside), "escape"):
        resp = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": path})
        error = assert_openai_error(resp, 403)
        assert path in error["message"] and error["param"] == "lora_path"
    missing = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "nope"})
    assert "nope" in assert_openai_error(missing, 400)["message"]
    assert "x" not in {card["id"] for card in http.get("/v1/models").json()["data"]}


def test_a_rank_over_max_lora_rank_is_a_400_with_the_engines_sentence(http) -> None:
    resp = http.post("/v1/load_lora_adapter", json={"lora_name": "w", "lora_path": "wide"})
    assert "max_lora_rank" in assert_openai_error(resp, 400)["message"]


def test_run_time_loading_is_admin_only_and_off_unless_allowed(served: Served) -> None:
    keys = json.loads(json.dumps([{"key": ADMIN_KEY, "tenant": "ops", "role": "admin"},
                                  {"key": USER_KEY, "tenant": "team"}]))  # fmt: skip
    body = {"lora_name": "qv2", "lora_path": "qv"}
    for settings, key, status in (
        ({"api_keys": keys, "allow_runtime_lora": True, "lora_dir": served.lora_dir}, USER_KEY, 403),
        ({}, None, 403),  # off: no allow_runtime_lora
    ):  # fmt: skip
        server = RunningServer(create_app(served.client, GatewaySettings(**settings)))
        try:
            headers = {"Authorization": f"Bearer {key}"} if key else {}
            with httpx.Client(base_url=server.url, timeout=60, headers=headers) as client:
                for route in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
                    error = assert_openai_error(client.post(route, json=body), status)
                    assert ("admin" if key else "allow_runtime_lora") in error["message"]
        finally:
            server.stop()
    assert "qv2" not in served.client.adapters()
