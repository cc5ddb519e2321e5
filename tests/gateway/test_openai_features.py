"""The official `openai` client parses every new response shape from the gateway:
logprobs (completions and chat, streamed and not), n choices, best_of, echo with prompt
logprobs, batched prompts, JSON mode; and the discovery routes (/openapi.json, /docs,
/tokenize, /detokenize, /version, served model aliases)."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.gateway.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS, wait_idle


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_completion_logprobs_and_echo(oai, refs, client):
    r = oai.completions.create(model="default", prompt=COMPLETION_PROMPT,
                               max_tokens=REF_MAX_TOKENS, temperature=0, logprobs=3)  # fmt: skip
    choice = r.choices[0]
    assert choice.text == refs.completion.text
    lp = choice.logprobs
    assert lp is not None and len(lp.tokens) == len(refs.completion.token_ids)
    assert all(len(top) >= 1 for top in lp.top_logprobs)
    # greedy: each token is the most likely one
    assert [max(top, key=top.get) for top in lp.top_logprobs] == lp.tokens
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    scored = oai.completions.create(model="default", prompt=COMPLETION_PROMPT, max_tokens=0,
                                    echo=True, logprobs=1, temperature=0)  # fmt: skip
    s = scored.choices[0]
    assert s.text == COMPLETION_PROMPT and s.finish_reason == "length"
    assert len(s.logprobs.tokens) == len(refs.completion_prompt_ids)
    assert s.logprobs.token_logprobs[0] is None
    assert all(v <= 0 for v in s.logprobs.token_logprobs[1:])
    assert scored.usage.completion_tokens == 0
    echoed = oai.completions.create(
        model="default",
        prompt=COMPLETION_PROMPT,
        echo=True,
        max_tokens=REF_MAX_TOKENS,
        logprobs=2,
        temperature=0,
    )
    e = echoed.choices[0]
    assert e.text == COMPLETION_PROMPT + refs.completion.text
    assert e.logprobs.token_logprobs[1:len(s.logprobs.token_logprobs)] == pytest.approx(
        s.logprobs.token_logprobs[1:], abs=1e-4)  # fmt: skip


def test_completion_stream_logprobs_n_and_batched_prompts(oai, refs, client):
    chunks = list(oai.completions.create(
        model="default", prompt=[COMPLETION_PROMPT, "Two plus two is"], n=2, temperature=0,
        max_tokens=REF_MAX_TOKENS, logprobs=1, stream=True,
        stream_options={"include_usage": True}))  # fmt: skip
    by_index: dict[int, str] = {}
    tokens: dict[int, int] = {}
    for c in chunks:
        for ch in c.choices:
            by_index[ch.index] = by_index.get(ch.index, "") + ch.text
            if ch.logprobs is not None:
                tokens[ch.index] = tokens.get(ch.index, 0) + len(ch.logprobs.tokens)
    assert sorted(by_index) == [0, 1, 2, 3]
    assert by_index[0] == by_index[1] == refs.completion.text  # greedy: equal choices
    assert by_index[2] == by_index[3] and by_index[2] != by_index[0]
    assert tokens[0] == len(refs.completion.token_ids)
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens == sum(tokens.values())
    full = oai.completions.create(
        model="default",
        prompt=[COMPLETION_PROMPT, "Two plus two is"],
        temperature=0.9,
        seed=5,
        max_tokens=6,
        n=2,
        best_of=3,
    )
    assert [c.index for c in full.choices] == [0, 1, 2, 3]
    second = len(client.tokenizer.encode("Two plus two is"))
    assert full.usage.prompt_tokens == len(refs.completion_prompt_ids) + second
    assert 2 * 3 <= full.usage.completion_tokens <= 2 * 3 * 6  # every best_of candidate
    assert all(c.logprobs is None for c in full.choices)  # not asked for


def test_chat_logprobs_n_and_json_mode(oai, refs):
    r = oai.chat.completions.create(model="default", messages=CHAT_MESSAGES, temperature=0,
                                    max_tokens=REF_MAX_TOKENS, logprobs=True, top_logprobs=2,
                                    n=2)  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    for c in r.choices:
        assert c.message.content == refs.chat.text
        content = c.logprobs.content
        assert len(content) == len(refs.chat.token_ids)
        for entry in content:
            assert entry.top_logprobs[0].token == entry.token
            assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
    stream = list(
        oai.chat.completions.create(
            model="default",
            messages=CHAT_MESSAGES,
            temperature=0,
            max_tokens=REF_MAX_TOKENS,
            logprobs=True,
            top_logprobs=1,
            stream=True,
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    entries = [e for c in stream if c.choices and c.choices[0].logprobs
               for e in c.choices[0].logprobs.content]  # fmt: skip
    assert text == refs.chat.text and len(entries) == len(refs.chat.token_ids)
    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]},
              "count": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["colour", "count"], "additionalProperties": False}  # fmt: skip
    for fmt in (
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    ):
        j = oai.chat.completions.create(model="default", messages=CHAT_MESSAGES, temperature=0,
                                        max_tokens=40, response_format=fmt)  # fmt: skip
        if j.choices[0].finish_reason == "stop":
            value = json.loads(j.choices[0].message.content)
            assert isinstance(value, dict)
            if fmt["type"] == "json_schema":
                assert set(value) == {"colour", "count"} and value["colour"] in ("red", "green")
        else:  # a free-form object may run past 40 tokens
            assert fmt["type"] == "json_object"


def test_tokenize_detokenize_version_openapi(http, refs, serve_app):
    t = http.post("/tokenize", json={"prompt": COMPLETION_PROMPT}).json()
    assert t["tokens"] == refs.completion_prompt_ids and t["count"] == len(t["tokens"])
    assert t["max_model_len"] > 0
    chat = http.post("/tokenize", json={"messages": CHAT_MESSAGES}).json()
    assert chat["count"] == refs.chat.prompt_tokens
    # template variables pass through (this model's template has no use for this one)
    extra = {"messages": CHAT_MESSAGES, "chat_template_kwargs": {"enable_thinking": False}}
    assert http.post("/tokenize", json=extra).json()["tokens"] == chat["tokens"]
    bad = http.post("/tokenize", json={**extra, "chat_template_kwargs": {"messages": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    d = http.post("/detokenize", json={"tokens": refs.completion_prompt_ids}).json()
    assert d["prompt"] == COMPLETION_PROMPT
    assert http.post("/detokenize", json={"tokens": [10**8]}).status_code == 400
    assert http.get("/version").json()["version"]
    spec = http.get("/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = ref["schema"]["$ref"].rsplit("/", 1)[1]
        assert name in spec["components"]["schemas"]
    props = spec["components"]["schemas"]["CompletionRequest"]["properties"]
    assert {"logprobs", "echo", "n", "best_of", "logit_bias", "presence_penalty"} <= set(props)
    assert http.get("/docs").status_code == 200
    gw = serve_app(served_model_name="alpha,beta")
    with httpx.Client(base_url=gw.url, timeout=60) as c:
        assert [m["id"] for m in c.get("/v1/models").json()["data"]] == ["alpha", "beta"]
        body = {"prompt": "Hi", "max_tokens": 1}
        for name in ("alpha", "beta", "default"):
            r = c.post("/v1/completions", json={**body, "model": name})
            assert r.status_code == 200 and r.json()["model"] == "alpha"
        assert c.post("/v1/completions", json={**body, "model": "gamma"}).status_code == 404
    wait_idle(http)
