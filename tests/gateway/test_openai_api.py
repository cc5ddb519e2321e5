"""The OpenAI API over real HTTP: outputs equal the engine's, streaming format, usage,
prefix-cache accounting, disconnects, models/health/metrics/debug endpoints."""

from __future__ import annotations

import json
import re

import httpx

from radixserve.model.identity import weights_fingerprint
from radixserve.model.model_files import resolve_model_path
from tests.gateway.conftest import (
    CHAT_MESSAGES,
    COMPLETION_PROMPT,
    REF_MAX_TOKENS,
    wait_idle,
)

GREEDY = {"temperature": 0, "max_tokens": REF_MAX_TOKENS}


def sse_events(response: httpx.Response) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE response; '[DONE]' stays a string."""
    events: list[dict | str] = []
    for line in response.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), line
        data = line[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(http: httpx.Client, path: str, body: dict) -> list[dict | str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response)


def check_usage(usage: dict, prompt_tokens: int, completion_tokens: int) -> None:
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["completion_tokens"] == completion_tokens
    assert usage["total_tokens"] == prompt_tokens + completion_tokens
    assert 0 <= usage["prompt_tokens_details"]["cached_tokens"] < prompt_tokens


def test_completion_matches_engine(http, refs):
    r = http.post(
        "/v1/completions", json={"model": "default", "prompt": COMPLETION_PROMPT, **GREEDY}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["text"] == refs.completion.text
    assert choice["finish_reason"] == refs.completion.finish_reason
    check_usage(body["usage"], refs.completion.prompt_tokens, len(refs.completion.token_ids))


def test_completion_token_id_prompts_match_engine(http, refs):
    for prompt in (refs.completion_prompt_ids, [refs.completion_prompt_ids], [COMPLETION_PROMPT]):
        r = http.post("/v1/completions", json={"prompt": prompt, **GREEDY})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == refs.completion.text


def test_completion_stream(http, server, refs):
    body = {"prompt": COMPLETION_PROMPT, "stream_options": {"include_usage": True}, **GREEDY}
    events = stream(http, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in events[:-1]}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == refs.completion.text
    assert [c["choices"][0]["finish_reason"] for c in chunks[:-1]] == [None] * (len(chunks) - 1)
    assert chunks[-1]["choices"][0]["finish_reason"] == refs.completion.finish_reason
    assert usage_chunk["choices"] == []
    check_usage(usage_chunk["usage"], refs.completion.prompt_tokens, len(refs.completion.token_ids))


def test_stream_without_include_usage_has_no_usage(http, refs):
    events = stream(http, "/v1/completions", {"prompt": COMPLETION_PROMPT, **GREEDY})
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and len(e["choices"]) == 1 for e in events[:-1])
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == refs.completion.text


def test_chat_matches_engine(http, refs):
    r = http.post("/v1/chat/completions", json={"messages": CHAT_MESSAGES, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    [choice] = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": refs.chat.text}
    assert choice["finish_reason"] == refs.chat.finish_reason
    check_usage(body["usage"], refs.chat.prompt_tokens, len(refs.chat.token_ids))


def test_chat_stream(http, refs):
    body = {
        "messages": CHAT_MESSAGES,
        "temperature": 0,
        "max_completion_tokens": REF_MAX_TOKENS,
        "stream_options": {"include_usage": True},
    }
    events = stream(http, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    *chunks, usage_chunk, _ = events
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == refs.chat.text
    assert chunks[-1]["choices"][0]["finish_reason"] == refs.chat.finish_reason
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    assert all(c["usage"] is None for c in chunks)
    assert usage_chunk["choices"] == []
    check_usage(usage_chunk["usage"], refs.chat.prompt_tokens, len(refs.chat.token_ids))


def test_repeated_long_prompt_is_served_from_cache(http):
    prompt = " ".join(f"item {i} is a {['red', 'blue', 'green'][i % 3]} box;" for i in range(60))
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    first = http.post("/v1/completions", json=body).json()
    second = http.post("/v1/completions", json=body).json()
    assert first["usage"]["prompt_tokens"] == second["usage"]["prompt_tokens"] > 200
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 200
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_sampling_controls_are_honoured(http):
    base = {"prompt": COMPLETION_PROMPT, "ignore_eos": True}
    r = http.post("/v1/completions", json={**base, "max_tokens": 7, "temperature": 0}).json()
    assert r["usage"]["completion_tokens"] == 7 and r["choices"][0]["finish_reason"] == "length"
    seeded = {**base, "max_tokens": 8, "temperature": 1.0, "top_p": 0.9, "top_k": 50, "seed": 7}
    a = http.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
    b = http.post("/v1/completions", json=seeded).json()["choices"][0]["text"]
    assert a == b
    chat = {"messages": CHAT_MESSAGES, "temperature": 0, "max_tokens": 50, "ignore_eos": True}
    r = http.post("/v1/chat/completions", json={**chat, "max_completion_tokens": 3}).json()
    assert r["usage"]["completion_tokens"] == 3
    full = http.post("/v1/chat/completions", json=chat).json()["choices"][0]["message"]["content"]
    word = full.split()[2]
    stopped = http.post("/v1/chat/completions", json={**chat, "stop": [word]}).json()
    assert stopped["choices"][0]["finish_reason"] == "stop"
    assert word not in stopped["choices"][0]["message"]["content"]
    assert full.startswith(stopped["choices"][0]["message"]["content"])


def test_models_health_debug(http, client):
    models = http.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [client.served_name]
    # the identity of what computes its pages: the default GGUF's bytes, as loaded
    identity = models["data"][0]["identity"]
    assert identity["weights"] == weights_fingerprint(resolve_model_path("default"))
    assert identity["quantization"].startswith("int4") and identity["adapter"] == ""
    assert identity == {**client.identity.to_dict(), "short": client.identity.short}
    assert http.get("/debug/cache").json()["model_identity"] == identity
    health = http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    r = http.post(
        "/v1/completions", json={"model": client.served_name, "prompt": "Hi", "max_tokens": 2}
    )
    assert r.status_code == 200, r.text
    stats = wait_idle(http)
    for key in ("pages_used", "pages_locked", "pages_evictable", "pages_free", "live_requests"):
        assert isinstance(stats[key], int)
    assert stats["pages_used"] > 0 and stats["pages_free"] > 0


def test_disconnect_mid_stream_aborts_request(http, server):
    body = {"prompt": COMPLETION_PROMPT, "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with (
        httpx.Client(base_url=server.url, timeout=60) as own,
        own.stream("POST", "/v1/completions", json=body) as response,
    ):
        lines = response.iter_lines()
        seen = [line for line, _ in zip(lines, range(6)) if line]
        assert seen and all(s.startswith("data: ") for s in seen)
        busy = http.get("/debug/cache").json()
        assert busy["live_requests"] == 1 and busy["gateway_in_flight"] == 1
    stats = wait_idle(http)
    assert stats["live_requests"] == 0 and stats["pages_locked"] == 0, stats
    assert stats["gateway_in_flight"] == 0
    metrics = http.get("/metrics").text
    assert re.search(r'radixserve_requests_total\{finish_reason="abort"\} [1-9]', metrics)


def _sample(metrics: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    assert match, f"{name} missing"
    return float(match.group(1))


def test_metrics(http):
    body = {"prompt": COMPLETION_PROMPT, "max_tokens": 5, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert sse_events(response)[-1] == "[DONE]"
    wait_idle(http)
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    m = r.text
    assert _sample(m, "radixserve_ttft_seconds_count") >= 1
    assert _sample(m, "radixserve_itl_seconds_count") >= 4
    assert _sample(m, "radixserve_e2e_seconds_count") >= 1
    assert (
        0
        < _sample(m, "radixserve_ttft_seconds_sum")
        < 60 * _sample(m, "radixserve_ttft_seconds_count")
    )
    prompt = _sample(m, "radixserve_prompt_tokens_total")
    cached = _sample(m, 'radixserve_cached_tokens_total{tier="device"}')
    assert _sample(m, 'radixserve_cached_tokens_total{tier="host"}') == 0  # no host tier
    computed = _sample(m, "radixserve_prefill_computed_tokens_total")
    assert prompt > 0 and prompt == cached + computed
    assert _sample(m, 'radixserve_requests_total{finish_reason="length"}') >= 1
    assert _sample(m, "radixserve_queue_depth") == 0
    assert _sample(m, "radixserve_live_requests") == 0
    used, free = _sample(m, "radixserve_pages_used"), _sample(m, "radixserve_pages_free")
    assert used > 0 and used + free == _sample(m, "radixserve_pages_total")
    assert _sample(m, "radixserve_pages_locked") == 0
