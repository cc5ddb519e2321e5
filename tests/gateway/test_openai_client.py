"""The official `openai` Python client works against the gateway: chat and completions,
streaming and not, usage, errors surfacing as the client's exception types."""

from __future__ import annotations

import openai
import pytest

from tests.gateway.conftest import CHAT_MESSAGES, COMPLETION_PROMPT, REF_MAX_TOKENS


@pytest.fixture
def oai(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as c:
        yield c


def test_client_completions(oai, refs):
    r = oai.completions.create(
        model="default", prompt=COMPLETION_PROMPT, max_tokens=REF_MAX_TOKENS, temperature=0
    )
    assert r.choices[0].text == refs.completion.text
    assert r.choices[0].finish_reason == refs.completion.finish_reason
    assert r.usage is not None and r.usage.completion_tokens == len(refs.completion.token_ids)
    chunks = list(
        oai.completions.create(
            model="default",
            prompt=COMPLETION_PROMPT,
            max_tokens=REF_MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == refs.completion.text
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.prompt_tokens == refs.completion.prompt_tokens


def test_client_chat(oai, refs, client):
    r = oai.chat.completions.create(
        model=client.served_name,
        messages=CHAT_MESSAGES,
        max_completion_tokens=REF_MAX_TOKENS,
        temperature=0,
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == refs.chat.text
    assert r.usage is not None and r.usage.prompt_tokens == refs.chat.prompt_tokens
    stream = oai.chat.completions.create(
        model="default",
        messages=CHAT_MESSAGES,
        max_tokens=REF_MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == refs.chat.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == refs.chat.finish_reason
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == len(refs.chat.token_ids)
    # the same prompt again: its full pages came from the cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens > 0


def test_client_models_and_errors(oai, client):
    assert [m.id for m in oai.models.list()] == [client.served_name]
    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="default", prompt="hi", max_tokens=-1)
    assert "max_tokens" in info.value.message
