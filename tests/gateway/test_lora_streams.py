"""LoRA adapters loaded and unloaded at run time while requests stream, on one engine over
HTTP: the streams (the base model's and an adapter's, two prompts each) are held between
two engine steps while one adapter is loaded, another unloaded and a request on the new
one joins them; then every stream ends with the engine's own answer, nothing failed, and
the engine holds nothing (no live request, page, lock or reservation).

The hold steps nothing while it lasts; the calls the engine thread runs between steps
(loads, unloads, admissions) still run, so they happen while the streams are live.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.engine import Engine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.settings import EngineSettings
from tests.engine.engine_helpers import assert_no_leaks, write_tiny_model
from tests.gateway.conftest import RunningServer, assert_openai_error, wait_idle
from tests.gateway.lora_helpers import greedy_text, write_adapters

pytest.importorskip("peft")

NEW_TOKENS = 24
PROMPTS = {"a": list(range(40, 40 + 37)), "b": list(range(100, 100 + 21))}


@dataclass
class Served:
    engine: Engine
    front: AsyncEngine
    client: LocalEngineClient
    lora_dir: Path  # "qv" and "all"
    refs: dict[tuple[str, str], str]  # (prompt, adapter) -> greedy text


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("lora_streams")
    model = write_tiny_model(root / "model")
    lora_dir = root / "adapters"
    dirs = write_adapters(model, lora_dir, ("qv", "all"))
    gone = shutil.copytree(dirs["qv"], root / "gone")  # served from the start, unloaded
    modules = (f"qv={dirs['qv']}", f"gone={gone}")
    engine = Engine(EngineSettings(model=str(model), device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.05, lora_modules=modules))  # fmt: skip
    engine.load_lora("all", str(dirs["all"]))  # for its references; unloaded below
    refs = {(p, a): greedy_text(engine, prompt, a, NEW_TOKENS)
            for p, prompt in PROMPTS.items() for a in ("", "qv", "all")}  # fmt: skip
    engine.unload_lora("all")
    front = AsyncEngine(engine)
    client = LocalEngineClient(front)
    yield Served(engine, front, client, lora_dir, refs)
    client.close()


class StepHold:
    """Wraps ``engine.step``: steps nothing until ``n`` requests are live (so they run in
    the same batches from their first token), then steps as usual until each has two
    tokens, then steps nothing again until ``release`` is set. While it steps nothing, the
    engine thread still runs the calls between steps (admissions, loads, unloads)."""

    def __init__(self, engine: Engine, n: int) -> None:
        self._engine, self._step, self._n = engine, engine.step, n
        self._gathered = False
        self.tokens: Counter[str] = Counter()  # request id -> tokens so far
        self.held, self.release = threading.Event(), threading.Event()

    def __call__(self) -> list[Any]:
        if not self._gathered:
            self._gathered = self._engine.cache_stats()["live_requests"] >= self._n
        waiting = not self._gathered or self.held.is_set()
        if waiting and not self.release.is_set():
            self.release.wait(0.001)  # the engine loop runs its calls, then steps again
            return []
        outputs = self._step()
        for out in outputs:
            self.tokens[out.request_id] += len(out.new_token_ids)
        if len(self.tokens) == self._n and min(self.tokens.values()) >= 2:
            self.held.set()
        return outputs


def _stream(url: str, prompt: str, model: str, answers: dict[tuple[str, str], Any]) -> None:
    """Stream a greedy completion; its text and finish reason (or the failure) in
    ``answers[(prompt, model)]``."""
    body = {"model": model, "prompt": PROMPTS[prompt], "max_tokens": NEW_TOKENS,
            "min_tokens": NEW_TOKENS, "temperature": 0, "stream": True}  # fmt: skip
    text, reasons = "", []
    try:
        with (
            httpx.Client(base_url=url, timeout=60) as client,
            client.stream("POST", "/v1/completions", json=body) as events,
        ):
            if events.status_code != 200:
                events.read()
                answers[prompt, model] = f"HTTP {events.status_code}: {events.text}"
                return
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    choice = json.loads(line[6:])["choices"][0]
                    text += choice["text"]
                    reasons.append(choice["finish_reason"])
        answers[prompt, model] = (text, [r for r in reasons if r])
    except Exception as exc:  # reported by the test
        answers[prompt, model] = repr(exc)


def _on_engine(front: AsyncEngine, fn: Callable[[Engine], Any]) -> Any:
    """``fn(engine)`` on the engine thread, between two steps; its value (or raise)."""
    done: concurrent.futures.Future[Any] = concurrent.futures.Future()

    def run(engine: Engine) -> None:
        try:
            done.set_result(fn(engine))
        except BaseException as exc:
            done.set_exception(exc)

    front.submit(run)
    return done.result(timeout=30)


def test_streams_end_right_while_adapters_load_and_unload(served: Served, monkeypatch) -> None:
    """Four streams (base model and "qv", two prompts) are live when "all" is loaded and
    "gone" unloaded (both while each stream has its first tokens and none has ended);
    "qv" is refused unloading (in use); a stream on "all" joins them; every stream then
    ends with the engine's answer, and nothing is held afterwards."""
    engine = served.engine
    for prompt in PROMPTS:  # each adapter changes the answer
        assert len({served.refs[prompt, a] for a in ("", "qv", "all")}) == 3
    hold = StepHold(engine, 4)
    monkeypatch.setattr(engine, "step", hold)
    live_at: dict[str, int] = {}  # adapter call -> live requests at that moment
    for method in ("load_lora", "unload_lora"):
        real = getattr(engine, method)

        def observed(*args: Any, _real: Any = real, _method: str = method) -> Any:
            live_at.setdefault(_method, engine.cache_stats()["live_requests"])
            return _real(*args)

        monkeypatch.setattr(engine, method, observed)
    settings = GatewaySettings(allow_runtime_lora=True, lora_dir=served.lora_dir)
    server = RunningServer(create_app(served.client, settings))
    answers: dict[tuple[str, str], Any] = {}
    jobs = [(p, m) for p in PROMPTS for m in ("default", "qv")]
    readers = [threading.Thread(target=_stream, args=(server.url, p, m, answers)) for p, m in jobs]
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            for reader in readers:
                reader.start()
            assert hold.held.wait(60), hold.tokens
            load = http.post("/v1/load_lora_adapter", json={"lora_name": "all",
                                                            "lora_path": "all"})  # fmt: skip
            assert load.status_code == 200, load.text
            unload = http.post("/v1/unload_lora_adapter", json={"lora_name": "gone"})
            assert unload.status_code == 200, unload.text
            busy = http.post("/v1/unload_lora_adapter", json={"lora_name": "qv"})
            assert "in use" in assert_openai_error(busy, 400)["message"]
            assert_openai_error(http.post("/v1/completions", json={"model": "gone",
                                                                   "prompt": "hi"}), 404)  # fmt: skip
            late = threading.Thread(target=_stream, args=(server.url, "a", "all", answers))
            late.start()
            readers.append(late)
            hold.release.set()
            for reader in readers:
                reader.join(60)
            assert live_at == {"load_lora": 4, "unload_lora": 4}  # both while all 4 streamed
            for prompt, model in [*jobs, ("a", "all")]:
                adapter = "" if model == "default" else model
                want = (served.refs[prompt, adapter], ["length"])
                assert answers[prompt, model] == want, (prompt, model)
            stats = wait_idle(http)
            assert stats["live_requests"] == 0 and stats["pages_locked"] == 0, stats
            assert 'running_lora_adapters=""' in http.get("/metrics").text
    finally:
        hold.release.set()
        server.stop()
    assert set(served.client.adapters()) == {"qv", "all"}
    _on_engine(served.front, assert_no_leaks)  # no live request, lock, reservation
    assert _on_engine(served.front, lambda e: sorted(e.loras.adapters)) == ["all", "qv"]
