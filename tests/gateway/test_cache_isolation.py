"""Cache isolation through a real gateway over the tiny model in process: each tenant's
requests share cached KV only with the tenant's own (or its declared group's), a
``cache_salt`` narrows that further, and ``cached_tokens`` reports only that sharing.
``cache_salt`` and ``prompt_cache_key`` are accepted on completions, chat and Responses
(the Messages API, its key in ``x-api-key``, isolates the same way);
a value of the wrong type is refused by name."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error

A1 = "acme-first-key-0123456789"
A2 = "acme-second-key-0123456789"
B = "bare-key-of-tenant-b-0123"
G1 = "group-member-one-0123456789"
G2 = "group-member-two-0123456789"
KEYS = [
    {"key": A1, "tenant": "acme"},
    {"key": A2, "tenant": "acme"},
    B,
    {"key": G1, "tenant": "one", "cache_group": "public-prompts"},
    {"key": G2, "tenant": "two", "cache_group": "public-prompts"},
]
SYSTEM = (
    "You are the internal assistant of the acme treasury desk. Hedging policy: currency "
    "forwards up to twelve months, interest rate swaps only against booked debt, no "
    "commodity options; every position over the limit needs two signatures from the desk. "
)
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def body(endpoint: str, text: str, question: str = "Who signs?", **extra: Any) -> dict[str, Any]:
    """A request of ``text`` as the system prompt (the instructions), then ``question``."""
    base: dict[str, Any] = {"model": "default", "temperature": 0, **extra}
    if endpoint == "/v1/completions":
        return {**base, "prompt": text + question, "max_tokens": 3}
    if endpoint == "/v1/chat/completions":
        messages = [{"role": "system", "content": text}, {"role": "user", "content": question}]
        return {**base, "messages": messages, "max_tokens": 3}
    return {**base, "instructions": text, "input": question, "max_output_tokens": 3}


def cached(resp: httpx.Response) -> int:
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    details = usage.get("prompt_tokens_details") or usage.get("input_tokens_details")
    return int(details["cached_tokens"])


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    client = LocalEngineClient(AsyncEngine(make_engine(TINY, kv_cache_memory_gib=0.05)))
    running = RunningServer(create_app(client, GatewaySettings(api_keys=KEYS)))
    with httpx.Client(base_url=running.url, timeout=60) as http:
        yield http
    running.stop()
    client.close()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_tenants_share_only_their_own_cache(http: httpx.Client, endpoint: str) -> None:
    text = f"Served at {endpoint}. " + SYSTEM  # a prompt of its own
    first = http.post(endpoint, json=body(endpoint, text), headers=auth(A1))
    assert cached(first) == 0
    other_tenant = cached(http.post(endpoint, json=body(endpoint, text), headers=auth(B)))
    same_tenant = cached(http.post(endpoint, json=body(endpoint, text), headers=auth(A2)))
    assert other_tenant == 0  # B cannot tell that A sent this prompt
    assert same_tenant >= 32  # A's other key shares A's pages


def test_the_messages_api_shares_only_the_tenants_own_cache(http: httpx.Client) -> None:
    """Anthropic's Messages API, its key in ``x-api-key``: the same isolation, reported
    as ``cache_read_input_tokens``."""
    text = "Served at /v1/messages. " + SYSTEM

    def read(key: str) -> int:
        request = {"model": "default", "max_tokens": 3, "temperature": 0, "system": text,
                   "messages": [{"role": "user", "content": "Who signs?"}]}  # fmt: skip
        resp = http.post("/v1/messages", json=request, headers={"x-api-key": key})
        assert resp.status_code == 200, resp.text
        return int(resp.json()["usage"]["cache_read_input_tokens"])

    assert read(A1) == 0
    assert read(B) == 0  # B cannot tell that A sent this prompt
    assert read(A2) >= 32  # A's other key shares A's pages


def test_a_cache_salt_narrows_sharing_inside_the_tenant(http: httpx.Client) -> None:
    endpoint = "/v1/chat/completions"
    text = "Options desk. " + SYSTEM

    def send(key: str, **extra: Any) -> int:
        return cached(http.post(endpoint, json=body(endpoint, text, **extra), headers=auth(key)))

    assert send(A1, cache_salt="conversation-7") == 0
    assert send(A2, cache_salt="conversation-8") == 0  # another salt: nothing shared
    assert send(A2) == 0  # no salt: not the salted requests' pages either
    assert send(A2, cache_salt="conversation-7") >= 32  # the same salt, same tenant: shared
    assert send(B, cache_salt="conversation-7") == 0  # a salt never crosses tenants


def test_a_cache_group_shares_across_its_tenants(http: httpx.Client) -> None:
    endpoint = "/v1/completions"
    text = "A public prompt, shared on purpose. " + SYSTEM
    assert cached(http.post(endpoint, json=body(endpoint, text), headers=auth(G1))) == 0
    assert cached(http.post(endpoint, json=body(endpoint, text), headers=auth(G2))) >= 32
    assert cached(http.post(endpoint, json=body(endpoint, text), headers=auth(B))) == 0


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_cache_fields_are_accepted_and_bad_values_refused_by_name(
    http: httpx.Client, endpoint: str
) -> None:
    ok = body(endpoint, "Hello", cache_salt="s-1", prompt_cache_key="conversation-1")
    assert http.post(endpoint, json=ok, headers=auth(A1)).status_code == 200
    for field, bad in (
        ("cache_salt", 7),
        ("cache_salt", ""),
        ("cache_salt", ["s"]),
        ("cache_salt", "s" * 257),
        ("cache_salt", "\udb3d"),  # a lone surrogate: no UTF-8 form to hash
        ("prompt_cache_key", 7),
        ("prompt_cache_key", "k" * 257),
    ):
        raw = json.dumps(body(endpoint, "Hello", **{field: bad}))  # \u-escapes a surrogate
        headers = {**auth(A1), "Content-Type": "application/json"}
        resp = http.post(endpoint, content=raw, headers=headers)
        error = assert_openai_error(resp, 400)
        assert field in (error["param"] or "") + error["message"], (field, bad, error)
