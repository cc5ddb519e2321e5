"""Preparation off the loop, limits before work: the size caps on schemas, tools, choice
lists, regexes and grammars refuse a request (400 naming the field) before anything is
compiled; templates, tokenization and grammars run in the bounded `Preparer` pool under
``prepare_timeout_s``, and the event loop keeps answering ``/live`` meanwhile."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from radixserve.engine import grammar
from radixserve.services.gateway.gateway import Gateway
from tests.gateway.conftest import RunningServer, assert_openai_error

#: a prompt that takes the tokenizer seconds (≈0.5-1 s per MiB here) and fits the body limit
SLOW_TEXT = "the quick brown fox jumps over the lazy dog, " * (6 << 20 >> 6)


def _big_schema(num_bytes: int) -> dict:
    """A JSON schema of about `num_bytes` bytes (object properties with descriptions)."""
    count = num_bytes // 100 + 1
    return {"type": "object", "properties": {
        f"field_{i}": {"type": "string", "description": "d" * 64} for i in range(count)}}  # fmt: skip


def _gateway(running: RunningServer) -> Gateway:
    gw: Gateway = running.server.config.app.state.gateway
    return gw


@pytest.fixture
def compiles(monkeypatch) -> Iterator[list[str]]:
    """Every guide the process compiles (through `grammar_for`, the compiler's entry)."""
    seen: list[str] = []
    original = grammar.grammar_for

    def counting(kind: str, guide: str) -> str:
        seen.append(kind)
        return original(kind, guide)

    for module in (
        "radixserve.services.gateway.openai_api.plan",
        "radixserve.services.gateway.tools.tool_request",
    ):
        monkeypatch.setattr(f"{module}.grammar_for", counting)
    yield seen


def _tool(name: str, parameters: dict | None = None) -> dict:
    function = {"name": name, "parameters": parameters or {"type": "object"}}
    return {"type": "function", "function": function}


ASK = [{"role": "user", "content": "hi"}]
THREE_MIB_SCHEMA = _big_schema(3 << 20)

OVER_CAP = {  # body -> (path, the field the 400 names)
    "3 MiB response_format schema": ("/v1/chat/completions", {
        "messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": THREE_MIB_SCHEMA}}}, "response_format"),
    "3 MiB guided_json": ("/v1/completions", {"prompt": "x", "guided_json": THREE_MIB_SCHEMA},
                          "guided_json"),
    "3 MiB text.format.schema": ("/v1/responses", {"input": "hi", "text": {"format": {
        "type": "json_schema", "name": "big", "schema": THREE_MIB_SCHEMA}}},
        "text.format.schema"),
    "129 tools": ("/v1/chat/completions", {
        "messages": ASK, "tools": [_tool(f"f{i}") for i in range(129)]}, "tools"),
    "a tool's 128 KiB parameters": ("/v1/chat/completions", {
        "messages": ASK, "tools": [_tool("a"), _tool("b", _big_schema(128 << 10))],
        "tool_choice": "required"}, "tools[1].function.parameters"),
    "forced call over max_schema_bytes": ("/v1/chat/completions", {
        "messages": ASK, "tool_choice": "required",
        "tools": [_tool(f"f{i}", _big_schema(40 << 10)) for i in range(8)]}, "tools"),
    "257 guided choices": ("/v1/completions", {
        "prompt": "x", "guided_choice": [f"c{i}" for i in range(257)]}, "guided_choice"),
    "a 2000-character choice": ("/v1/completions", {
        "prompt": "x", "guided_choice": ["a", "b" * 2000]}, "guided_choice[1]"),
    "a 5000-character regex": ("/v1/completions", {"prompt": "x", "guided_regex": "a" * 5000},
                               "guided_regex"),
    "a 70000-character grammar": ("/v1/completions", {
        "prompt": "x", "guided_grammar": 'start: "' + "a" * 70000 + '"'}, "guided_grammar"),
}  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), OVER_CAP.values(), ids=OVER_CAP.keys())
def test_over_a_cap_is_refused_by_name_before_any_compile(http, compiles, path, body, param):
    error = assert_openai_error(http.post(path, json=body), 400)
    assert error["param"] == param, error
    assert "max_" in error["message"] or "bound" in error["message"], error
    assert compiles == [], "the guide was compiled before its size was checked"


def test_within_the_caps_the_guide_is_compiled_once(http, compiles):
    """The counter sees compiles (so the test above can fail): one per request, not one
    per prompt."""
    body = {"prompt": ["a", "b", "c"], "max_tokens": 1, "guided_choice": ["yes", "no"]}
    assert http.post("/v1/completions", json=body).status_code == 200
    assert compiles == ["choice"]


def test_the_caps_are_settings(serve_app, compiles):
    running = serve_app(max_tools=2, max_guided_choices=2)
    with httpx.Client(base_url=running.url, timeout=60) as http:
        three = {"messages": ASK, "tools": [_tool(f"f{i}") for i in range(3)]}
        assert assert_openai_error(http.post("/v1/chat/completions", json=three), 400)[
            "param"] == "tools"  # fmt: skip
        body = {"prompt": "x", "guided_choice": ["a", "b", "c"]}
        error = assert_openai_error(http.post("/v1/completions", json=body), 400)
        assert error["param"] == "guided_choice" and "max_guided_choices" in error["message"]
    assert compiles == []


def _post_in_background(url: str, path: str, body: dict) -> tuple[threading.Thread, list]:
    result: list[httpx.Response] = []

    def post() -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            result.append(http.post(path, json=body))

    thread = threading.Thread(target=post, daemon=True)
    thread.start()
    return thread, result


def test_live_answers_while_a_request_is_prepared(serve_app, capsys):
    """A prompt that takes the tokenizer seconds is prepared in a worker: /live answers
    meanwhile (measured, printed), and a 3 MiB schema is refused by its cap while that
    work is still running."""
    running = serve_app(prepare_timeout_s=120)
    gw = _gateway(running)
    slow, slow_result = _post_in_background(
        running.url, "/v1/completions", {"prompt": SLOW_TEXT, "max_tokens": 1}
    )
    latencies, overlapped = [], 0
    with httpx.Client(base_url=running.url, timeout=60) as http:
        while not gw.preparer.num_pending and slow.is_alive():
            time.sleep(0.005)
        big = {"messages": ASK, "response_format": {"type": "json_schema", "json_schema": {
            "name": "big", "schema": THREE_MIB_SCHEMA}}}  # fmt: skip
        refused = http.post("/v1/chat/completions", json=big)
        refused_during = slow.is_alive()
        while slow.is_alive():
            started = time.perf_counter()
            assert http.get("/live").status_code == 200
            latencies.append(time.perf_counter() - started)
            overlapped += slow.is_alive()
            time.sleep(0.02)
    slow.join()
    assert_openai_error(refused, 400)
    assert refused.json()["error"]["param"] == "response_format"
    assert refused_during, "the 3 MiB schema waited for the slow preparation"
    assert overlapped >= 1, "/live was never answered while the slow request was prepared"
    assert max(latencies) < 1.0, latencies
    assert_openai_error(slow_result[0], 400)  # the prompt is longer than the context
    latencies.sort()
    with capsys.disabled():
        print(f"\n/live during preparation: {len(latencies)} answers, median "
              f"{latencies[len(latencies) // 2] * 1e3:.1f} ms, max {latencies[-1] * 1e3:.1f} ms")  # fmt: skip


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": SLOW_TEXT, "max_tokens": 1}, "prompt"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": SLOW_TEXT}]},
            "messages",
        ),
    ],  # fmt: skip
    ids=["completion", "chat"],
)
def test_preparation_past_its_timeout_is_a_400_naming_the_field(serve_app, path, body, param):
    """One worker: the slow request times out while running (400 naming the field); a
    small one queued behind it times out before it ever runs (429), and never runs."""
    running = serve_app(prepare_workers=1, prepare_timeout_s=0.5)
    gw = _gateway(running)
    slow, slow_result = _post_in_background(running.url, path, body)
    with httpx.Client(base_url=running.url, timeout=60) as http:
        while not gw.preparer.num_pending and slow.is_alive():
            time.sleep(0.005)
        queued = http.post("/v1/completions", json={"prompt": "hello", "max_tokens": 1})
    slow.join()
    error = assert_openai_error(slow_result[0], 400)
    assert error["param"] == param and "prepare_timeout_s" in error["message"], error
    assert_openai_error(queued, 429)
    assert queued.headers.get("retry-after")
    gw.preparer.close(wait=True)  # the timed-out step finishes in its thread: wait for it
    assert gw.preparer.num_pending == 0
