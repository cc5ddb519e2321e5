"""GET /debug/traces on a real gateway over the tiny model in process: each generation
request's trace continues the client's ``traceparent`` (or starts a new one for a
malformed header), is listed newest first and served span by span, behind the API keys;
the route table's traced rows, and only they, are traced;
bad parameters are refused by name, an unknown trace is a 404; with no trace buffer and
no OTLP endpoint, tracing is off. (Spans of the workers: tests/cluster/test_tracing.py.)"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.routing import APIRoute

from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from radixserve.services.gateway.routes import ROUTES
from radixserve.tracing import parse_traceparent
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error

KEY = "sk-trace-test-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
BODY = {"model": "default", "prompt": "Once upon a time", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def tiny_client() -> Iterator[LocalEngineClient]:
    client = LocalEngineClient(AsyncEngine(make_engine(TINY, kv_cache_memory_gib=0.02)))
    yield client
    client.close()


def _serve(client: LocalEngineClient, **settings) -> Iterator[httpx.Client]:
    running = RunningServer(create_app(client, GatewaySettings(**settings)))
    with httpx.Client(base_url=running.url, timeout=60) as http:
        yield http
    running.stop()


@pytest.fixture(scope="module")
def keyed(tiny_client) -> Iterator[httpx.Client]:
    yield from _serve(tiny_client, api_keys=[{"key": KEY, "role": "admin"}], trace_buffer=4)


def _complete(http: httpx.Client, traceparent: str | None = None, **extra) -> httpx.Response:
    headers = {**AUTH, **({"traceparent": traceparent} if traceparent else {})}
    resp = http.post("/v1/completions", json={**BODY, **extra}, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def test_a_request_continues_the_clients_trace(keyed):
    resp = _complete(keyed, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
    answered = parse_traceparent(resp.headers["traceparent"])
    assert answered is not None and answered.trace_id == CLIENT_TRACE
    assert answered.span_id != CLIENT_SPAN  # the gateway's own span
    [summary] = [t for t in keyed.get("/debug/traces", headers=AUTH).json()["traces"]
                 if t["trace_id"] == CLIENT_TRACE]  # fmt: skip
    assert summary["request_id"] == resp.json()["id"]
    assert summary["root_name"] == "gateway.request" and summary["span_count"] == 1
    assert summary["duration_ms"] > 0 and summary["start_ns"] > 0
    body = keyed.get(f"/debug/traces/{CLIENT_TRACE}", headers=AUTH).json()
    assert body["trace_id"] == CLIENT_TRACE and body["client_span_id"] == CLIENT_SPAN
    [root] = body["spans"]
    assert root["span_id"] == answered.span_id and root["parent_span_id"] is None
    assert root["service"] == "gateway" and root["end_ns"] > root["start_ns"]
    assert root["attributes"]["http.status_code"] == 200
    assert root["attributes"]["http.route"] == "/v1/completions"
    assert root["attributes"]["request_id"] == resp.json()["id"]
    assert BODY["prompt"] not in str(body)  # token counts, never text


def test_the_route_tables_traced_column_picks_the_traced_routes(tiny_client, keyed):
    """Every route is a row of `ROUTES`; a POST to a traced row gets a span (its
    ``traceparent`` answered, a refusal too), one to any other row none."""
    app = create_app(tiny_client, GatewaySettings())  # not served: only its routes are read
    app.state.gateway.preparer.close()
    served = {(r.path, m) for r in app.routes if isinstance(r, APIRoute) for m in r.methods}
    assert served == {(r.path, r.method) for r in ROUTES}
    traced = {r.path for r in ROUTES if r.traced}
    assert traced == {"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"}
    for route in ROUTES:
        if route.method == "POST":
            resp = keyed.post(route.path, json={}, headers=AUTH)
            assert ("traceparent" in resp.headers) == route.traced, (route.path, resp.text)


def test_a_malformed_traceparent_starts_a_new_trace(keyed):
    resp = _complete(keyed, f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01")
    answered = parse_traceparent(resp.headers["traceparent"])
    assert answered is not None and answered.trace_id != CLIENT_TRACE.upper().lower()
    body = keyed.get(f"/debug/traces/{answered.trace_id}", headers=AUTH).json()
    assert body["client_span_id"] is None


def test_traces_are_listed_newest_first_and_the_oldest_leave(keyed):
    streamed = _complete(keyed, stream=True)  # its span ends when the stream has been sent
    ids = [parse_traceparent(_complete(keyed).headers["traceparent"]) for _ in range(4)]
    ids.insert(0, parse_traceparent(streamed.headers["traceparent"]))
    listed = keyed.get("/debug/traces", params={"limit": 4}, headers=AUTH).json()["traces"]
    assert [t["trace_id"] for t in listed] == [c.trace_id for c in reversed(ids[1:])]  # type: ignore[union-attr]
    gone = keyed.get(f"/debug/traces/{ids[0].trace_id}", headers=AUTH)  # type: ignore[union-attr]
    assert assert_openai_error(gone, 404)["param"] == "trace_id"
    everything = keyed.get("/debug/traces", params={"limit": 50}, headers=AUTH).json()
    assert len(everything["traces"]) == 4  # the buffer's size


def test_the_routes_want_a_key_and_name_bad_parameters(keyed):
    assert_openai_error(keyed.get("/debug/traces"), 401)
    assert_openai_error(keyed.get(f"/debug/traces/{CLIENT_TRACE}"), 401)
    wrong = {"Authorization": "Bearer sk-wrong"}
    assert_openai_error(keyed.get("/debug/traces", headers=wrong), 401)
    for limit in ("0", "65537", "x", "-1", "1.5"):
        error = assert_openai_error(keyed.get(f"/debug/traces?limit={limit}", headers=AUTH), 400)
        assert error["param"] == "limit"
    error = assert_openai_error(keyed.get("/debug/traces?since=3", headers=AUTH), 400)
    assert error["param"] == "since"
    unknown = keyed.get(f"/debug/traces/{'ab' * 16}", headers=AUTH)
    assert assert_openai_error(unknown, 404)["param"] == "trace_id"


def test_with_no_buffer_and_no_endpoint_tracing_is_off(tiny_client, monkeypatch):
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    for http in _serve(tiny_client, api_keys=[{"key": KEY, "role": "admin"}], trace_buffer=0):
        resp = _complete(http, f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")
        assert "traceparent" not in resp.headers
        assert http.get("/debug/traces", headers=AUTH).json() == {"traces": []}
        assert_openai_error(http.get(f"/debug/traces/{CLIENT_TRACE}", headers=AUTH), 404)
