"""Tenants and roles on a real gateway over the tiny model in process: each key acts for a
tenant; stored responses, the request log and traces belong to it (another tenant's id is
the same 404 as a missing one); the operator routes need an admin key; and the key
settings refuse what cannot be a key, by name, printing no key."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

from radixserve.engine.async_engine import AsyncEngine
from radixserve.protocol.security import InsecureBindError
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.services.gateway.ops.request_log import RequestLog
from radixserve.services.gateway.server.trace_store import TraceStore
from radixserve.services.gateway.tenancy.tenants import ANONYMOUS, Keyring, Principal, key_tenant
from radixserve.tracing import Tracer
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error

A1 = "acme-first-key-0123456789"
A2 = "acme-second-key-0123456789"
B = "bare-key-of-tenant-b-0123"
ADMIN = "operator-admin-key-0123456789"
KEYS = [{"key": A1, "tenant": "acme"}, {"key": A2, "tenant": "acme", "role": "user"}, B,
        {"key": ADMIN, "tenant": "ops", "role": "admin"}]  # fmt: skip
BODY = {"model": "default", "temperature": 0, "max_output_tokens": 3}
ADMIN_ROUTES = ("/debug/cache", "/debug/explorer/requests", "/debug/explorer/workers",
                "/debug/traces", "/explorer")  # fmt: skip


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    client = LocalEngineClient(AsyncEngine(make_engine(TINY, kv_cache_memory_gib=0.02)))
    running = RunningServer(create_app(client, GatewaySettings(api_keys=KEYS, trace_buffer=16)))
    with httpx.Client(base_url=running.url, timeout=60) as http:
        yield http
    running.stop()
    client.close()


def stored(http: httpx.Client, key: str, text: str) -> str:
    resp = http.post("/v1/responses", json={**BODY, "input": text}, headers=auth(key))
    assert resp.status_code == 200, resp.text
    return str(resp.json()["id"])


def test_a_stored_response_is_its_tenants(http: httpx.Client) -> None:
    rid = stored(http, A1, "my secret code is 7342")
    paths = (f"/v1/responses/{rid}", f"/v1/responses/{rid}/input_items")
    missing = assert_openai_error(http.get("/v1/responses/resp_missing", headers=auth(B)), 404)
    for path in paths:  # another tenant: the same 404 as an id never stored
        error = assert_openai_error(http.get(path, headers=auth(B)), 404)
        assert error["message"] == missing["message"].replace("resp_missing", rid)
        assert http.get(path, headers=auth(A2)).status_code == 200  # the tenant's other key
        assert http.get(path, headers=auth(ADMIN)).status_code == 200
    items = http.get(paths[1], headers=auth(A2)).json()["data"]
    assert "7342" in json.dumps(items)
    assert_openai_error(http.delete(paths[0], headers=auth(B)), 404)
    continued = {**BODY, "input": "and again?", "previous_response_id": rid}
    error = assert_openai_error(http.post("/v1/responses", json=continued, headers=auth(B)), 404)
    assert error["param"] == "previous_response_id"
    resp = http.post("/v1/responses", json=continued, headers=auth(A2))
    assert resp.status_code == 200, resp.text
    assert http.delete(paths[0], headers=auth(A2)).json()["deleted"] is True
    assert_openai_error(http.get(paths[0], headers=auth(A1)), 404)


def test_operator_routes_need_an_admin_key(http: httpx.Client) -> None:
    stored(http, B, "a request of tenant b")
    for path in ADMIN_ROUTES:
        for key in (A1, B):
            assert_openai_error(http.get(path, headers=auth(key)), 403)
        assert_openai_error(http.get(path), 401)
        assert http.get(path, headers=auth(ADMIN)).status_code == 200, path
    assert_openai_error(http.get("/explorer", params={"key": B}), 403)
    assert http.get("/explorer", params={"key": ADMIN}).status_code == 200
    assert_openai_error(http.post("/debug/cache/audit/clear", headers=auth(B)), 403)
    assert_openai_error(http.post("/debug/cache/audit/clear"), 401)
    assert http.post("/debug/cache/audit/clear", headers=auth(ADMIN)).status_code == 200
    # the admin sees every tenant's requests and traces
    listed = http.get("/debug/explorer/requests", headers=auth(ADMIN)).json()["requests"]
    assert {r["tenant"] for r in listed} >= {key_tenant(B)}
    assert http.get("/debug/traces", headers=auth(ADMIN)).json()["traces"]
    # the API itself takes any key; /metrics and /health none
    assert http.get("/v1/models", headers=auth(B)).status_code == 200
    assert http.get("/metrics").status_code == 200
    assert B not in http.get("/metrics").text and "acme" not in http.get("/metrics").text


def test_the_request_log_lists_a_callers_own() -> None:
    log = RequestLog(8)
    for rid, tenant in (("r1", "acme"), ("r2", "other"), ("r3", "acme")):
        log.begin(rid, "chat", None, 1, tenant)
    acme = Principal("acme", "user")
    assert [r["request_id"] for r in log.recent(10, acme)] == ["r3", "r1"]
    assert [r["request_id"] for r in log.recent(1, acme)] == ["r3"]
    assert len(log.recent(10, Principal("acme", "admin"))) == 3
    assert log.recent(10, Principal("nobody", "user")) == []


# -- the key settings --------------------------------------------------------------------


def test_key_entries_become_principals() -> None:
    keys = GatewaySettings(api_keys=KEYS).keyring()
    assert keys.principal(A1) == keys.principal(A2) == Principal("acme", "user")
    assert keys.principal(ADMIN) == Principal("ops", "admin")
    bare = keys.principal(B)
    assert bare is not None and bare.role == "user" and bare.tenant == key_tenant(B)
    assert B not in bare.tenant and bare.tenant == key_tenant(B)  # stable, not the key
    assert keys.principal("") is None and keys.principal(A1 + "x") is None
    group = Keyring(GatewaySettings(api_keys=[{"key": A1, "cache_group": "public"}]).api_keys)
    principal = group.principal(A1)
    assert principal is not None and principal.cache_group == "public"
    assert not GatewaySettings().keyring() and ANONYMOUS.is_admin


@pytest.mark.parametrize(
    ("entries", "said"),
    [
        ([""], "at least 16 characters"),
        (["short-key"], "at least 16 characters"),
        ([{"key": A1, "tokens_per_hour": 10}], "tokens_per_hour"),
        ([{"key": A1, "tokens_per_minute": 0}], "tokens_per_minute"),
        ([{"key": A1, "role": "root"}], "role"),
        ([{"key": A1, "tenant": "key:abc"}], "tenant"),
        ([A1, {"key": A1, "tenant": "acme"}], "listed twice"),
        (["replace-me-with-openssl-rand-hex-32"], "placeholder"),
    ],
)
def test_bad_keys_are_refused_by_name_without_printing_them(entries, said) -> None:
    with pytest.raises(ValidationError) as info:
        GatewaySettings(api_keys=entries)
    text = str(info.value)
    assert said in text and "api_keys" in text.lower()
    assert A1 not in text and "short-key" not in text


def test_the_empty_key_from_the_environment_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_GATEWAY_API_KEYS", '[""]')
    with pytest.raises(ValidationError, match="at least 16 characters"):
        GatewaySettings()


def test_a_key_file_adds_keys(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    listed = tmp_path / "keys.json"
    listed.write_text(json.dumps([{"key": ADMIN, "role": "admin"}, B]))
    lines = tmp_path / "keys.txt"
    lines.write_text(f"# one key a line\n{A1}\n\n{A2}\n")
    settings = GatewaySettings(api_keys=[B + "-more"], api_key_file=lines)
    assert [settings.keyring().principal(k) is not None for k in (A1, A2, B + "-more")] == [
        True, True, True]  # fmt: skip
    monkeypatch.setenv("RADIXSERVE_GATEWAY_API_KEYS_FILE", str(listed))
    principal = GatewaySettings().keyring().principal(ADMIN)
    assert principal is not None and principal.is_admin
    monkeypatch.delenv("RADIXSERVE_GATEWAY_API_KEYS_FILE")
    bad = tmp_path / "bad.txt"
    bad.write_text("short\n")
    for path, said in ((bad, "at least 16"), (tmp_path / "none", "cannot read")):
        with pytest.raises(ValidationError, match=said) as info:
            GatewaySettings(api_key_file=path)
        assert str(path) in str(info.value)
    dumped = json.dumps(GatewaySettings(api_keys=KEYS).model_dump(mode="json"))
    assert all(key not in dumped for key in (A1, A2, B, ADMIN))


def test_beyond_loopback_the_gateway_needs_keys() -> None:
    GatewaySettings(host="127.0.0.1").require_secure()
    GatewaySettings(host="::1").require_secure()
    with pytest.raises(InsecureBindError, match="RADIXSERVE_GATEWAY_API_KEYS"):
        GatewaySettings(host="0.0.0.0").require_secure()
    GatewaySettings(host="0.0.0.0", api_keys=[B]).require_secure()
    GatewaySettings(host="0.0.0.0", allow_unauthenticated=True).require_secure()
    with pytest.raises(InsecureBindError, match="RADIXSERVE_CLUSTER_SECRET"):
        GatewaySettings(kvstore="tcp://kvstore:7000").require_secure()
    secret = "a-cluster-secret-0123456789"
    GatewaySettings(kvstore="tcp://kvstore:7000", cluster_secret=secret).require_secure()


def test_a_trace_is_listed_to_its_tenant_and_the_admins() -> None:
    store = TraceStore(8)
    tracer = Tracer("gateway", keep=True, max_spans=64)
    for tenant in ("acme", "other", None):  # None: refused before admission, no tenant
        span = tracer.start_request("gateway.request", None)
        span.set(request_id=f"r-{tenant}", **({"tenant": tenant} if tenant else {}))
        span.end(None)
        store.put(span)
    listed = [t["request_id"] for t in store.summaries(10, Principal("acme", "user"))]
    assert listed == ["r-acme"]
    assert len(store.summaries(10, Principal("acme", "admin"))) == 3
    [other] = store.summaries(10, Principal("other", "user"))
    assert store.trace(other["trace_id"], Principal("acme", "user")) is None
    assert store.trace(other["trace_id"], Principal("other", "user")) is not None
