"""Gateway test fixtures: the real default model behind a real uvicorn server.

One engine (SmolLM2-135M-Instruct, fp32, CPU) is loaded per session. Greedy reference
outputs are computed with the engine's own synchronous `generate` before the
`AsyncEngine` thread takes it over. `serve_app` starts an app on a free 127.0.0.1 port
in a background thread (with the server configuration `radixserve serve` runs,
`http_server.server_config`) and stops it when the test ends.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import uvicorn

from radixserve.engine.async_engine import AsyncEngine
from radixserve.engine.outputs import GenerationResult
from radixserve.engine.sampling_params import SamplingParams
from radixserve.runtime.engine_client import EngineClient
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.services.gateway.server.http_server import server_config
from tests.engine.engine_helpers import TINY, make_engine

COMPLETION_PROMPT = "The capital of France is"
CHAT_MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
REF_MAX_TOKENS = 12


@dataclass(frozen=True)
class References:
    """Greedy engine outputs for the reference prompts (max_tokens=REF_MAX_TOKENS)."""

    completion: GenerationResult
    completion_prompt_ids: list[int]
    chat: GenerationResult


class RunningServer:
    """uvicorn serving one app on 127.0.0.1 in a daemon thread."""

    def __init__(self, app) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        gateway = getattr(getattr(app, "state", None), "gateway", None)  # not if wrapped
        settings = gateway.settings if gateway is not None else GatewaySettings()
        metrics = gateway.metrics if gateway is not None else None
        config = server_config(app, settings, metrics, lifespan="off")
        self.server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._sock = sock
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=20)
        self._sock.close()
        assert not self._thread.is_alive(), "uvicorn did not stop"


@pytest.fixture(scope="session")
def gateway_engine():
    """(LocalEngineClient, References): the references come first, from the sync engine."""
    engine = make_engine("default", kv_cache_memory_gib=0.1)
    params = SamplingParams(max_tokens=REF_MAX_TOKENS, temperature=0.0)
    prompt_ids = engine.tokenize(COMPLETION_PROMPT)
    completion = engine.generate([COMPLETION_PROMPT], params)[0]
    chat = engine.generate([engine.tokenizer.encode_chat(CHAT_MESSAGES)], params)[0]
    client = LocalEngineClient(AsyncEngine(engine))
    yield client, References(completion, prompt_ids, chat)
    client.close()


@pytest.fixture(scope="session")
def client(gateway_engine) -> LocalEngineClient:
    return gateway_engine[0]


@pytest.fixture(scope="session")
def refs(gateway_engine) -> References:
    return gateway_engine[1]


@pytest.fixture(scope="session")
def server(client) -> Iterator[RunningServer]:
    """The default gateway (no API keys) for the whole session."""
    running = RunningServer(create_app(client, GatewaySettings()))
    yield running
    running.stop()


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture
def serve_app(client) -> Iterator[Callable[..., RunningServer]]:
    """Start extra gateways (given GatewaySettings fields) on the shared engine."""
    started: list[RunningServer] = []

    def start(**settings) -> RunningServer:
        running = RunningServer(create_app(client, GatewaySettings(**settings)))
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture(scope="session")
def tiny_engine() -> Iterator[LocalEngineClient]:
    """The tiny random model's engine: long generations at little cost."""
    client = LocalEngineClient(AsyncEngine(make_engine(TINY, kv_cache_memory_gib=0.05)))
    yield client
    client.close()


@contextlib.contextmanager
def gateways(
    engine_of: Callable[..., EngineClient],
) -> Iterator[Callable[..., tuple[RunningServer, httpx.Client]]]:
    """A starter of gateways on the engine ``engine_of(*args)`` gives, with the given
    GatewaySettings fields: (server, an HTTP client of it); all stopped on exit."""
    started: list[tuple[RunningServer, httpx.Client]] = []

    def start(*args: Any, **settings: Any) -> tuple[RunningServer, httpx.Client]:
        running = RunningServer(create_app(engine_of(*args), GatewaySettings(**settings)))
        started.append((running, httpx.Client(base_url=running.url, timeout=60)))
        return started[-1]

    try:
        yield start
    finally:
        for running, http in started:
            http.close()
            running.stop()


@pytest.fixture
def tiny_gateway(tiny_engine) -> Iterator[Callable[..., tuple[RunningServer, httpx.Client]]]:
    """Start gateways (given GatewaySettings fields) on the tiny engine: (server, an
    HTTP client of it); both stopped after the test."""
    with gateways(lambda: tiny_engine) as start:
        yield start


def wait_idle(http: httpx.Client, timeout: float = 15.0) -> dict:
    """Poll /debug/cache until no request is live, in flight or locking pages."""
    deadline = time.monotonic() + timeout
    while True:
        stats = http.get("/debug/cache").json()
        idle = (
            stats["live_requests"] == 0
            and stats["pages_locked"] == 0
            and stats["gateway_in_flight"] == 0
        )
        if idle or time.monotonic() > deadline:
            return stats
        time.sleep(0.05)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    """The response has `status` and an OpenAI error object; returns the error dict."""
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert error["code"] == status
    return error
