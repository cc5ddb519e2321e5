"""Bad input gets the right status and an OpenAI error object, and the server carries
on: malformed bodies, wrong types, out-of-range values, unsupported options, unknown
models, API keys, body size limit, and the bounded in-flight queue (429)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.gateway.conftest import COMPLETION_PROMPT, assert_openai_error, wait_idle

OK_COMPLETION = {"prompt": COMPLETION_PROMPT, "max_tokens": 2}
OK_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

BAD_COMPLETIONS = {
    "prompt wrong type": {"prompt": 123},
    "prompt missing": {"max_tokens": 2},
    "empty prompt": {"prompt": ""},
    "empty token list": {"prompt": []},
    "empty nested prompt": {"prompt": [[]]},
    "too many prompts": {"prompt": ["a"] * 257},
    "one empty prompt of two": {"prompt": ["a", ""]},
    "token id outside vocab": {"prompt": [1, 10**9]},
    "negative token id": {"prompt": [-1]},
    "max_tokens string": {**OK_COMPLETION, "max_tokens": "5"},
    "max_tokens bool": {**OK_COMPLETION, "max_tokens": True},
    "max_tokens zero": {**OK_COMPLETION, "max_tokens": 0},
    "max_tokens negative": {**OK_COMPLETION, "max_tokens": -3},
    "max_tokens over pool": {**OK_COMPLETION, "max_tokens": 100_000},
    "min_tokens over max": {**OK_COMPLETION, "min_tokens": 5},
    "temperature negative": {**OK_COMPLETION, "temperature": -0.5},
    "temperature string": {**OK_COMPLETION, "temperature": "hot"},
    "top_p zero": {**OK_COMPLETION, "top_p": 0},
    "top_p above one": {**OK_COMPLETION, "top_p": 1.5},
    "top_k below -1": {**OK_COMPLETION, "top_k": -2},
    "seed too large": {**OK_COMPLETION, "seed": 2**70},
    "stop wrong type": {**OK_COMPLETION, "stop": 5},
    "empty stop string": {**OK_COMPLETION, "stop": [""]},
    "too many stops": {**OK_COMPLETION, "stop": [f"s{i}" for i in range(17)]},
    "negative stop token": {**OK_COMPLETION, "stop_token_ids": [-1]},
    "n above 128": {**OK_COMPLETION, "n": 129},
    "best_of below n": {**OK_COMPLETION, "n": 3, "best_of": 2},
    "best_of streamed": {**OK_COMPLETION, "best_of": 2, "stream": True},
    "suffix": {**OK_COMPLETION, "suffix": "tail"},
    "logprobs above 20": {**OK_COMPLETION, "logprobs": 21},
    "presence_penalty above 2": {**OK_COMPLETION, "presence_penalty": 2.5},
    "frequency_penalty below -2": {**OK_COMPLETION, "frequency_penalty": -3},
    "repetition_penalty zero": {**OK_COMPLETION, "repetition_penalty": 0},
    "logit_bias not a token id": {**OK_COMPLETION, "logit_bias": {"x": 1}},
    "logit_bias outside vocab": {**OK_COMPLETION, "logit_bias": {"100000": 1}},
    "logit_bias above 100": {**OK_COMPLETION, "logit_bias": {"5": 101}},
    "json_schema without schema": {
        **OK_COMPLETION,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x"}},
    },
    "bad regex": {**OK_COMPLETION, "guided_regex": "(("},
    "two guides": {**OK_COMPLETION, "guided_regex": "a", "guided_choice": ["b"]},
    "stream not bool": {**OK_COMPLETION, "stream": "yes"},
    "stream_options wrong type": {**OK_COMPLETION, "stream": True, "stream_options": 1},
    "streamed bad value": {**OK_COMPLETION, "stream": True, "temperature": -1},
}

BAD_CHATS = {
    "messages missing": {"max_tokens": 2},
    "messages not a list": {"messages": "hi"},
    "messages empty": {"messages": []},
    "message without content": {"messages": [{"role": "user"}]},
    "message without role": {"messages": [{"content": "hi"}]},
    "bad content part": {"messages": [{"role": "user", "content": [{"type": "image"}]}]},
    "max_completion_tokens zero": {**OK_CHAT, "max_completion_tokens": 0},
    "top_logprobs without logprobs": {**OK_CHAT, "top_logprobs": 2},
    "top_logprobs above 20": {**OK_CHAT, "logprobs": True, "top_logprobs": 21},
    "n above 128": {**OK_CHAT, "n": 129},
    "tool role without tool_call_id": {"messages": [{"role": "tool", "content": "x"}]},
}


@pytest.mark.parametrize("body", BAD_COMPLETIONS.values(), ids=BAD_COMPLETIONS.keys())
def test_bad_completion_is_400(http, body):
    assert_openai_error(http.post("/v1/completions", json=body), 400)


@pytest.mark.parametrize("body", BAD_CHATS.values(), ids=BAD_CHATS.keys())
def test_bad_chat_is_400(http, body):
    assert_openai_error(http.post("/v1/chat/completions", json=body), 400)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**OK_COMPLETION, "max_tokens": -3}, "max_tokens"),
        ({**OK_COMPLETION, "temperature": -1.0}, "temperature"),
        ({**OK_COMPLETION, "top_p": 0}, "top_p"),
    ],
)
def test_out_of_range_error_names_the_param(http, body, param):
    error = assert_openai_error(http.post("/v1/completions", json=body), 400)
    assert error["param"] == param


def test_prompt_over_context_is_400(http, client):
    too_long = [1] * client.max_model_len
    for stream in (False, True):
        body = {"prompt": too_long, "max_tokens": 1, "stream": stream}
        error = assert_openai_error(http.post("/v1/completions", json=body), 400)
        assert "context" in error["message"]


@pytest.mark.parametrize(
    "raw",
    [b"{bad json", b"[1, 2]", b'"text"', b"", b'{"prompt": "\xff\xfe"}', b"[" * 100_000],
    ids=["malformed", "array", "string", "empty", "invalid utf-8", "deeply nested"],
)
def test_unparsable_body_is_400(http, raw):
    for path in ("/v1/completions", "/v1/chat/completions"):
        headers = {"content-type": "application/json"}
        assert_openai_error(http.post(path, content=raw, headers=headers), 400)


def test_unknown_model_is_404(http):
    for path, body in (("/v1/completions", OK_COMPLETION), ("/v1/chat/completions", OK_CHAT)):
        error = assert_openai_error(http.post(path, json={**body, "model": "gpt-4"}), 404)
        assert error["param"] == "model" and "gpt-4" in error["message"]


def test_unknown_route_and_method(http):
    assert_openai_error(http.get("/v1/nothing"), 404)
    assert_openai_error(http.get("/v1/completions"), 405)


def test_fields_openai_ignores_are_ignored_and_unknown_ones_refused(http):
    ignored = {"user": "u1", "service_tier": "auto"}
    chat_ignored = {**ignored, "metadata": {"k": "v"}, "store": False, "tools": []}
    for path, body, extra in (
        ("/v1/completions", OK_COMPLETION, ignored),
        ("/v1/chat/completions", OK_CHAT, chat_ignored),
    ):
        r = http.post(path, json={**body, **extra})
        assert r.status_code == 200, r.text
        for name, value in (
            ("some_future_field", [1]),
            ("functions", [{"name": "f"}]),
            ("audio", {"voice": "x"}),
        ):
            error = assert_openai_error(http.post(path, json={**body, name: value}), 400)
            assert error["param"] == name and name in error["message"]
    for name, value in (
        ("tools", [{"type": "retrieval"}]),
        ("tool_choice", "auto"),  # without tools
        ("store", True),
        ("modalities", ["audio"]),
    ):
        r = http.post("/v1/chat/completions", json={**OK_CHAT, name: value})
        assert assert_openai_error(r, 400)["param"].startswith(name)
    r = http.post("/v1/completions", json={**OK_COMPLETION, "suffix": "tail"})
    assert assert_openai_error(r, 400)["param"] == "suffix"


def test_values_past_the_wire_limits_are_400(http):
    for field, value in (("max_tokens", 2**31), ("top_k", 2**31), ("seed", 2**64)):
        r = http.post("/v1/completions", json={**OK_COMPLETION, field: value})
        assert assert_openai_error(r, 400)["param"] == field
    r = http.post("/v1/completions", json={**OK_COMPLETION, "max_tokens": 9000})
    error = assert_openai_error(r, 400)
    assert error["param"] == "max_tokens" and "tokens are left" in error["message"]
    r = http.post("/v1/chat/completions", json={**OK_CHAT, "stop_token_ids": [2**31]})
    assert assert_openai_error(r, 400)["param"].startswith("stop_token_ids")


def test_server_still_serves_after_bad_input(http):
    http.post("/v1/completions", content=b"\x00\xff", headers={"content-type": "application/json"})
    assert http.get("/health").status_code == 200
    r = http.post("/v1/completions", json=OK_COMPLETION)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    stats = wait_idle(http)
    assert stats["live_requests"] == 0 and stats["gateway_in_flight"] == 0


def test_body_over_limit_is_413(serve_app):
    gw = serve_app(max_body_bytes=1024)
    big = {"prompt": "x " * 2000, "max_tokens": 1}
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        assert_openai_error(c.post("/v1/completions", json=big), 413)
        chunks = (b"x" * 512 for _ in range(4))  # chunked: no content-length to trust
        assert_openai_error(c.post("/v1/completions", content=chunks), 413)
        assert c.post("/v1/completions", json=OK_COMPLETION).status_code == 200


def test_api_keys(serve_app):
    gw = serve_app(api_keys=["key-one-0123456789", "key-two-0123456789"])
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        for headers in (
            {},
            {"Authorization": "Bearer wrong"},
            {"Authorization": "key-one-0123456789"},
        ):
            assert_openai_error(c.post("/v1/completions", json=OK_COMPLETION, headers=headers), 401)
            assert_openai_error(c.get("/v1/models", headers=headers), 401)
            assert_openai_error(c.get("/debug/cache", headers=headers), 401)
        for key in ("key-one-0123456789", "key-two-0123456789"):
            auth = {"Authorization": f"Bearer {key}"}
            assert c.post("/v1/chat/completions", json=OK_CHAT, headers=auth).status_code == 200
            assert c.get("/v1/models", headers=auth).status_code == 200
        assert c.get("/health").status_code == 200


def test_full_queue_is_429_at_once(serve_app, http):
    gw = serve_app(max_queued_requests=1)
    long_stream = {
        "prompt": COMPLETION_PROMPT,
        "max_tokens": 400,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(base_url=gw.url, timeout=30) as c,
        httpx.Client(base_url=gw.url) as d,
        c.stream("POST", "/v1/completions", json=long_stream) as response,
    ):
        assert response.status_code == 200
        lines = response.iter_lines()  # kept: dropping the iterator closes the response
        assert next(lines).startswith("data: ")
        for path, body in (
            ("/v1/completions", OK_COMPLETION),
            ("/v1/chat/completions", OK_CHAT),
        ):
            # answered while the long stream still runs (queued behind it, it would
            # wait past the client's timeout)
            refused = d.post(path, json=body, timeout=30)
            assert_openai_error(refused, 429)
    wait_idle(http)
    with httpx.Client(base_url=gw.url, timeout=30) as c:
        assert c.post("/v1/completions", json=OK_COMPLETION).status_code == 200


def test_a_burst_of_four_times_the_bound_is_shed_at_once_and_the_rest_served(serve_app, http):
    gw = serve_app(max_queued_requests=2)
    body = {"prompt": COMPLETION_PROMPT, "max_tokens": 24, "ignore_eos": True, "temperature": 0}
    with httpx.Client(base_url=gw.url, timeout=60) as c, ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(lambda _: c.post("/v1/completions", json=body), range(8)))
        reference = c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) == {200, 429}, statuses
    assert statuses.count(200) >= 2
    served = min(r.elapsed for r in responses if r.status_code == 200)
    for r in responses:
        if r.status_code == 429:
            assert_openai_error(r, 429)
            assert r.headers["retry-after"] == "1"
            assert r.elapsed < served, (r.elapsed, served)  # shed, not queued behind them
        else:
            assert r.json()["usage"]["completion_tokens"] == 24
            assert r.json()["choices"][0]["text"] == reference
    metrics = httpx.get(f"{gw.url}/metrics").text
    assert 'radixserve_refused_requests_total{reason="in_flight"}' in metrics
    assert wait_idle(http)["gateway_in_flight"] == 0
