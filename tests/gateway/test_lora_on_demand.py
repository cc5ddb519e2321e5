"""LoRA adapters loaded by the first request naming them (``lora_load_on_demand``, vLLM's
LoRA resolver), on one engine over HTTP: a ``model`` that names a directory of
``lora_dir`` holding an adapter is loaded (once, however many requests ask at once) and
answers as the engine does with that adapter, and /v1/models lists it afterwards; names
with ``/`` or ``..`` name nothing, directories that lead outside ``lora_dir`` are refused,
what the engine refuses is a 400; off, the name stays a 404.

The tiny random model and adapters made with ``peft`` (`lora_helpers`); the references
are the engine's greedy texts with each adapter, run before the server starts.
"""

from __future__ import annotations

import asyncio
import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from pydantic import ValidationError

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.errors import ModelLoadError
from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.services.gateway.openai_api.lora_resolver import LoraResolver
from radixserve.services.gateway.server.errors import OpenAIError
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import write_tiny_model
from tests.gateway.conftest import RunningServer, assert_openai_error
from tests.gateway.lora_helpers import greedy_text, write_adapters

pytest.importorskip("peft")

NEW_TOKENS = 8
PROMPT = list(range(40, 40 + 37))


@dataclass
class Served:
    client: LocalEngineClient
    lora_dir: Path
    outside: Path  # an adapter directory outside lora_dir
    refs: dict[str, str]  # adapter -> greedy text of PROMPT


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("lora_on_demand")
    model = write_tiny_model(root / "model")
    lora_dir = root / "adapters"
    dirs = write_adapters(model, lora_dir, ("qv", "all", "wide"))
    outside = write_adapters(model, root / "elsewhere", ("qv",))["qv"]
    (lora_dir / "escape").symlink_to(outside)  # a directory link that leads outside
    leaky = lora_dir / "leaky"  # a directory inside whose weights link outside
    leaky.mkdir()
    shutil.copy(dirs["qv"] / "adapter_config.json", leaky)
    (leaky / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    shutil.copytree(dirs["qv"], lora_dir / "spare")  # asked for with the setting off only
    engine = Engine(EngineSettings(model=str(model), device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.05))  # fmt: skip
    for name in ("qv", "all"):  # for the references; unloaded below
        engine.load_lora(name, str(dirs[name]))
    refs = {a: greedy_text(engine, PROMPT, a, NEW_TOKENS) for a in ("", "qv", "all")}
    for name in ("qv", "all"):
        engine.unload_lora(name)
    client = LocalEngineClient(AsyncEngine(engine))
    yield Served(client, lora_dir, outside, refs)
    client.close()


@pytest.fixture(scope="module")
def http(served: Served) -> Iterator[httpx.Client]:
    settings = GatewaySettings(allow_runtime_lora=True, lora_dir=served.lora_dir,
                               lora_load_on_demand=True)  # fmt: skip
    server = RunningServer(create_app(served.client, settings))
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
    server.stop()


def _complete(http: httpx.Client, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                              "max_tokens": NEW_TOKENS, "temperature": 0})  # fmt: skip


def _models(http: httpx.Client) -> dict[str, dict[str, Any]]:
    return {card["id"]: card for card in http.get("/v1/models").json()["data"]}


def test_the_first_requests_load_the_adapter_once(served: Served, http, monkeypatch) -> None:
    """Three requests at once name "all", which is not loaded but is a directory of
    lora_dir: one load, then each answers as the engine does with the adapter; /v1/models
    lists it under the base model; a later request on another route finds it loaded."""
    assert "all" not in _models(http)
    assert served.refs["all"] != served.refs[""]
    loads: list[tuple[str, str]] = []
    load = served.client.load_adapter

    async def counted(name: str, path: str):  # type: ignore[no-untyped-def]
        loads.append((name, path))
        return await load(name, path)

    monkeypatch.setattr(served.client, "load_adapter", counted)
    together = threading.Barrier(3)
    answers: list[httpx.Response] = []

    def ask() -> None:
        together.wait(30)
        answers.append(_complete(http, "all"))

    threads = [threading.Thread(target=ask) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert len(answers) == 3
    for answer in answers:
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "all"
        assert answer.json()["choices"][0]["text"] == served.refs["all"]
    assert loads == [("all", str((served.lora_dir / "all").resolve()))]
    card = _models(http)["all"]
    assert card["root"] == str((served.lora_dir / "all").resolve()) and card["parent"]
    chat = http.post("/v1/chat/completions", json={"model": "all", "max_tokens": 2,
                                                   "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert chat.status_code == 200 and chat.json()["model"] == "all"
    assert len(loads) == 1


def test_escapes_and_non_adapters_are_refused(served: Served, http) -> None:
    """Names with "/" or "..", or of no adapter directory, are 404s; a directory that is
    (or holds) a link leading outside lora_dir is a 403 naming the model and no path; an
    adapter the engine refuses (rank over max_lora_rank) a 400 with its sentence. None is
    loaded, and the adapter outside is never read."""
    for name in ("../elsewhere/qv", "..", "qv/", "nope", str(served.outside)):
        error = assert_openai_error(_complete(http, name), 404)
        assert error["param"] == "model", name
    for name in ("escape", "leaky"):
        error = assert_openai_error(_complete(http, name), 403)
        assert error["param"] == "model" and name in error["message"]
        assert str(served.outside.parent) not in error["message"]
    error = assert_openai_error(_complete(http, "wide"), 400)
    assert "max_lora_rank" in error["message"] and error["param"] == "model"
    refused = {"escape", "leaky", "wide", "nope", "..", "../elsewhere/qv"}
    assert not refused & set(_models(http)) and not refused & set(served.client.adapters())
    assert all(served.outside.parent not in Path(info.path).parents
               for info in served.client.adapters().values())  # fmt: skip


def test_off_the_name_stays_a_404(served: Served) -> None:
    """Run-time loading allowed but not on demand: a directory's name is a 404, and
    nothing is loaded; on demand without run-time loading is refused by name."""
    settings = GatewaySettings(allow_runtime_lora=True, lora_dir=served.lora_dir)
    server = RunningServer(create_app(served.client, settings))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            error = assert_openai_error(_complete(http, "spare"), 404)
            assert "spare" in error["message"] and error["param"] == "model"
    finally:
        server.stop()
    assert "spare" not in served.client.adapters()
    with pytest.raises(ValidationError, match="lora_load_on_demand needs allow_runtime_lora"):
        GatewaySettings(lora_load_on_demand=True, lora_dir=served.lora_dir)


class _GatedClient:
    """What `LoraResolver` uses of an `EngineClient`: each load waits for ``gate``, then
    succeeds, or fails while ``fail`` is set."""

    def __init__(self) -> None:
        self.gate = asyncio.Event()
        self.fail = False
        self.loads: list[str] = []
        self.served: dict[str, object] = {}

    def adapters(self) -> dict[str, object]:
        return self.served

    async def load_adapter(self, name: str, path: str) -> object:
        self.loads.append(name)
        await self.gate.wait()
        if self.fail:
            raise ModelLoadError(f"{path}: broken")
        self.served[name] = info = type("Info", (), {"fingerprint": "sha256:" + "0" * 64})()
        return info


def test_concurrent_requests_share_one_load_and_a_failure_is_retried(tmp_path) -> None:
    """Five requests for the same new name while its load is in flight wait for that one
    load; a failed load fails each of its waiters with a 400, and the next request loads
    again."""
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    client = _GatedClient()
    resolver = LoraResolver(cast(EngineClient, client), tmp_path)

    async def five() -> list[object]:
        before = len(client.loads)
        loads = [asyncio.ensure_future(resolver.load("a")) for _ in range(5)]
        for _ in range(3):  # each request runs to its wait, the load to its gate
            await asyncio.sleep(0)
        assert len(client.loads) == before + 1 and not any(load.done() for load in loads)
        client.gate.set()
        return await asyncio.gather(*loads, return_exceptions=True)

    client.fail = True
    failed = asyncio.run(five())
    assert all(isinstance(e, OpenAIError) and e.status == 400 and "broken" in e.message
               for e in failed)  # fmt: skip
    client.fail, client.gate = False, asyncio.Event()
    assert asyncio.run(five()) == [True] * 5
    assert client.loads == ["a", "a"]  # the failure was not kept: loaded again, once
    assert asyncio.run(resolver.load("b")) is False  # no such directory
