"""Work-weighted admission with tenant shares and rates (`admission`), on a real gateway
over HTTP (the tiny model: long generations cost little): a tenant that floods is refused
past its share while another tenant is served; a tenant's requests_per_minute and
tokens_per_minute refuse the next request with Retry-After, naming the limit; without
keys the one tenant may use the whole capacity; what a request held is returned when its
response ends, its client gone or not. The ledger's arithmetic is checked on its own
with a hand-moved clock."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from radixserve.services.gateway import GatewaySettings
from radixserve.services.gateway.tenancy.admission import Admission, Refused
from radixserve.services.gateway.tenancy.tenants import TenantLimits
from tests.gateway.absent_clients import metric, wait_for
from tests.gateway.conftest import assert_openai_error

ACME = "acme-flooding-key-0123456789"
BETA = "beta-chatting-key-0123456789"
ADMIN = "operator-admin-key-0123456789"
RPM = "metered-requests-key-0123456789"
TPM = "metered-tokens-key-0123456789"
KEYS = [{"key": ACME, "tenant": "acme"}, {"key": BETA, "tenant": "beta"},
        {"key": ADMIN, "tenant": "ops", "role": "admin"},
        {"key": RPM, "tenant": "rpm", "requests_per_minute": 1},
        {"key": TPM, "tenant": "tpm", "tokens_per_minute": 1000}]  # fmt: skip
REFUSED = "radixserve_refused_requests_total"
#: capacity 10000 tokens of work, a tenant's share 5000; the streams are held unread for
#: as long as a test needs (no idle cut)
SETTINGS: dict[str, Any] = {"max_queued_work_tokens": 10000, "tenant_work_share": 0.5,
                            "stream_idle_timeout_s": 600}  # fmt: skip
#: 4 prompts x (1 + 1000) = 4004 tokens of work: within a share, most of it
FLOOD = {"model": "default", "prompt": ["Count"] * 4, "max_tokens": 1000, "ignore_eos": True,
         "stream": True}  # fmt: skip
SMALL_CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}],
              "max_tokens": 4}  # fmt: skip


def auth(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


@contextmanager
def held_stream(http: httpx.Client, body: dict[str, Any], key: str | None) -> Iterator[None]:
    """A streamed request admitted and left unread (its first event read); leaving the
    block closes the connection: the client is gone."""
    with http.stream("POST", "/v1/completions", json=body, headers=auth(key)) as response:
        assert response.status_code == 200, response.read()
        lines = response.iter_lines()  # kept: dropping the iterator closes the response
        assert next(lines).startswith("data: ")
        yield


def admission(http: httpx.Client, key: str | None = ADMIN) -> dict[str, Any]:
    stats: dict[str, Any] = http.get("/debug/cache", headers=auth(key)).json()
    return dict(stats["gateway_admission"])


def wait_released(http: httpx.Client, key: str | None = ADMIN) -> None:
    def empty() -> bool:
        now = admission(http, key)
        return now["work_tokens"] == 0 and now["requests"] == 0 and now["tenants"] == {}

    wait_for(empty, "the admission ledger empty")


@pytest.fixture
def keyed(tiny_gateway) -> httpx.Client:
    _, http = tiny_gateway(api_keys=KEYS, **SETTINGS)
    return http


def test_a_flooding_tenant_is_refused_past_its_share_while_another_is_served(keyed) -> None:
    with held_stream(keyed, FLOOD, ACME):
        held = admission(keyed)
        assert held["tenants"]["acme"] == {"work_tokens": 4004, "requests": 4}, held
        more = {**FLOOD, "prompt": "Count", "stream": False}  # 1001 more: past 5000
        refused = keyed.post("/v1/completions", json=more, headers=auth(ACME))
        error = assert_openai_error(refused, 429)
        assert "tenant acme is over its share" in error["message"], error
        assert "tenant_work_share 0.5" in error["message"], error
        assert int(refused.headers["retry-after"]) >= 1
        served = keyed.post("/v1/chat/completions", json=SMALL_CHAT, headers=auth(BETA))
        assert served.status_code == 200, served.text
        assert served.json()["usage"]["completion_tokens"] >= 1
        assert admission(keyed)["tenants"]["acme"]["work_tokens"] == 4004
    wait_released(keyed)  # the flood's client left: all it held is returned
    again = keyed.post("/v1/chat/completions", json=SMALL_CHAT, headers=auth(ACME))
    assert again.status_code == 200, again.text
    wait_released(keyed)
    metrics = keyed.get("/metrics").text
    assert metric(keyed, REFUSED, reason="tenant_share") == 1
    assert "acme" not in metrics and "beta" not in metrics  # counts, never tenants


def test_a_request_no_share_could_hold_is_a_400_naming_the_share(keyed) -> None:
    body = {**FLOOD, "prompt": ["Count"] * 5, "stream": False}  # 5005 > 5000
    error = assert_openai_error(keyed.post("/v1/completions", json=body, headers=auth(ACME)), 400)
    assert "charged 5005 tokens" in error["message"] and error["param"] == "max_tokens", error
    assert "tenant acme's share (5000" in error["message"], error
    assert metric(keyed, REFUSED, reason="too_large") == 1
    assert admission(keyed)["work_tokens"] == 0


def test_requests_per_minute_refuses_the_next_request_naming_it(keyed) -> None:
    assert keyed.post("/v1/chat/completions", json=SMALL_CHAT, headers=auth(RPM)).status_code == 200
    refused = keyed.post("/v1/chat/completions", json=SMALL_CHAT, headers=auth(RPM))
    error = assert_openai_error(refused, 429)
    assert "tenant rpm is over its requests_per_minute (1)" in error["message"], error
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    other = keyed.post("/v1/chat/completions", json=SMALL_CHAT, headers=auth(BETA))
    assert other.status_code == 200, other.text  # another tenant is not limited
    assert metric(keyed, REFUSED, reason="requests_per_minute") == 1


def test_tokens_per_minute_counts_the_charged_work(keyed) -> None:
    # 1 + 990 of the 1000 a minute is taken at admission, though the client leaves at once
    with held_stream(keyed, {**FLOOD, "prompt": "Count", "max_tokens": 990}, TPM):
        pass
    body = {**FLOOD, "prompt": "Count", "max_tokens": 500, "stream": False}
    refused = keyed.post("/v1/completions", json=body, headers=auth(TPM))
    error = assert_openai_error(refused, 429)
    assert "tenant tpm is over its tokens_per_minute (1000)" in error["message"], error
    assert "takes 501" in error["message"], error
    assert 1 <= int(refused.headers["retry-after"]) <= 60
    huge = {**body, "max_tokens": 1000}  # 1001: more than a minute's worth, ever
    error = assert_openai_error(keyed.post("/v1/completions", json=huge, headers=auth(TPM)), 400)
    assert "tenant tpm's tokens_per_minute (1000)" in error["message"], error
    assert keyed.post("/v1/completions", json=body, headers=auth(BETA)).status_code == 200
    assert metric(keyed, REFUSED, reason="tokens_per_minute") == 1
    wait_released(keyed)


def test_without_keys_the_one_tenant_may_use_the_whole_capacity(tiny_gateway) -> None:
    _, http = tiny_gateway(**SETTINGS)
    flood = {**FLOOD, "prompt": ["Count"] * 8}  # 8008: more than half of 10000
    with held_stream(http, flood, None):
        held = admission(http, None)
        assert (held["work_tokens"], held["requests"], held["tenant_work_share"]) == (8008, 8, 1)
        refused = http.post("/v1/completions", json={**flood, "stream": False})
        error = assert_openai_error(refused, 429)
        assert "max_queued_work_tokens" in error["message"], error
        assert refused.headers["retry-after"] == "1"
        small = {**FLOOD, "prompt": "Count", "max_tokens": 4, "stream": False}
        assert http.post("/v1/completions", json=small).status_code == 200
    wait_released(http, None)
    too_big = {**flood, "prompt": ["Count"] * 10, "stream": False}  # 10010 > 10000
    error = assert_openai_error(http.post("/v1/completions", json=too_big), 400)
    assert "max_queued_work_tokens (10000)" in error["message"], error
    assert metric(http, REFUSED, reason="capacity") == 1
    with held_stream(http, flood, None):  # all of it again, once released
        pass
    wait_released(http, None)


def test_a_finished_request_returns_its_charge(keyed) -> None:
    body = {**FLOOD, "prompt": ["Count"] * 4, "max_tokens": 8, "stream": False}
    for _ in range(3):
        resp = keyed.post("/v1/completions", json=body, headers=auth(ACME))
        assert resp.status_code == 200, resp.text
    streamed = {**body, "stream": True}
    with keyed.stream("POST", "/v1/completions", json=streamed, headers=auth(ACME)) as resp:
        assert resp.read().endswith(b"data: [DONE]\n\n")
    wait_released(keyed)


# -- the ledger on its own -------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_buckets_refill_evenly_and_a_refusal_takes_nothing() -> None:
    clock = Clock()
    limits = {"a": TenantLimits(tokens_per_minute=600, requests_per_minute=2),
              "b": TenantLimits()}  # fmt: skip
    ledger = Admission(10_000, 100, 0.5, limits, clock)
    ledger.release(ledger.admit("a", 500, 1))
    with pytest.raises(Refused) as refused:
        ledger.admit("a", 200, 1)  # 100 left; 10 a second: 10 s
    assert refused.value.reason == "tokens_per_minute"
    assert refused.value.headers == {"Retry-After": "10"}
    clock.now += 9.5
    with pytest.raises(Refused) as refused:
        ledger.admit("a", 200, 1)
    assert refused.value.headers == {"Retry-After": "1"}  # 0.5 s: at least 1
    clock.now += 0.5
    ledger.admit("a", 200, 1)  # the refusals took nothing: the second request
    with pytest.raises(Refused) as refused:
        ledger.admit("a", 1, 1)  # a third within the minute (2 a minute: one per 30 s)
    assert refused.value.reason == "requests_per_minute"
    assert refused.value.headers == {"Retry-After": "20"}  # 10 s refilled of 30
    ledger.admit("b", 5000, 1)  # another tenant: no limits, its share


def test_shares_and_the_cluster_bounds() -> None:
    ledger = Admission(1000, 10, 0.5, {"a": TenantLimits(), "b": TenantLimits()}, Clock())
    first = ledger.admit("a", 400, 2)
    with pytest.raises(Refused) as refused:
        ledger.admit("a", 101, 1)
    assert (refused.value.status, refused.value.reason) == (429, "tenant_share")
    ledger.admit("a", 100, 3)  # exactly its share of the work
    with pytest.raises(Refused) as refused:
        ledger.admit("a", 1, 1)  # and of the prompts (5 of 10)
    assert refused.value.reason == "tenant_share"
    with pytest.raises(Refused) as refused:
        ledger.admit("b", 501, 1)
    assert (refused.value.status, refused.value.reason) == (400, "too_large")
    with pytest.raises(Refused) as refused:
        ledger.admit("b", 1, 6)
    assert (refused.value.status, refused.value.reason) == (400, "too_large")
    ledger.admit("b", 500, 5)
    assert (ledger.work, ledger.requests) == (1000, 10)
    ledger.release(first)
    ledger.release(first)  # a second release returns nothing more
    assert (ledger.work, ledger.requests) == (600, 8)
    assert ledger.snapshot()["tenants"] == {"a": {"work_tokens": 100, "requests": 3},
                                            "b": {"work_tokens": 500, "requests": 5}}  # fmt: skip
    alone = Admission(1000, 10, 0.5, {"a": TenantLimits()}, Clock())
    alone.admit("a", 900, 9)  # one tenant: all of it
    with pytest.raises(Refused) as refused:
        alone.admit("a", 1, 2)
    assert refused.value.reason == "in_flight"
    with pytest.raises(Refused) as refused:
        alone.admit("a", 101, 1)
    assert refused.value.reason == "capacity"


# -- the key entries ---------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, -5, 1.5, "60", True])
@pytest.mark.parametrize("field", ["tokens_per_minute", "requests_per_minute"])
def test_a_limit_must_be_a_positive_int(field: str, value: object) -> None:
    with pytest.raises(ValidationError) as exc:
        GatewaySettings(api_keys=[{"key": ACME, "tenant": "acme", field: value}])
    assert field in str(exc.value)
    assert ACME not in str(exc.value)


def test_a_tenants_limits_are_shared_and_must_agree(tmp_path) -> None:
    keys = [{"key": ACME, "tenant": "acme", "tokens_per_minute": 100},
            {"key": BETA, "tenant": "acme", "requests_per_minute": 5}]  # fmt: skip
    limits = GatewaySettings(api_keys=keys).keyring().limits
    assert limits == {"acme": TenantLimits(tokens_per_minute=100, requests_per_minute=5)}
    clash = [keys[0], {**keys[1], "tokens_per_minute": 200}]
    with pytest.raises(ValidationError, match="tenant acme set tokens_per_minute to 100 and 200"):
        GatewaySettings(api_keys=clash)
    path = tmp_path / "keys.json"
    path.write_text(json.dumps([{"key": ACME, "tenant": "acme", "tokens_per_minite": 5}]))
    with pytest.raises(ValidationError, match="tokens_per_minite"):
        GatewaySettings(api_key_file=path)
