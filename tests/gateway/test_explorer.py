"""The explorer's routes on a real gateway over the tiny model in process: the API keys
on the page and its JSON, the tree with the conversation's shared prefix and its hits,
the ring of recent requests against the usage the API reported, no prompt text unless
allowed, bad parameters refused by name, and the autoscaler's decisions read from a real
autoscaler's /health. (The page drawn in a browser, on a cluster: tests/browser.)"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator

import httpx
import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.runtime.engine_client import LOCAL_WORKER
from radixserve.services.autoscaler.connectors import DryRunConnector
from radixserve.services.autoscaler.service import AutoscalerService
from radixserve.services.autoscaler.settings import AutoscalerSettings
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.autoscaler.test_service import _Scrapes, exposition
from tests.engine.engine_helpers import TINY, make_engine
from tests.gateway.conftest import RunningServer, assert_openai_error
from tests.test_worker_metrics import cluster_views

KEY = "sk-explorer-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: words that must never reach an explorer response or page while prompt text is off
SECRET = "quokka aubergine zanzibar"
SYSTEM = f"You are the {SECRET} assistant. " * 6


@pytest.fixture(scope="module")
def tiny_client() -> Iterator[LocalEngineClient]:
    client = LocalEngineClient(AsyncEngine(make_engine(TINY, kv_cache_memory_gib=0.02)))
    yield client
    client.close()


@pytest.fixture(scope="module")
def keyed(tiny_client) -> Iterator[httpx.Client]:
    running = RunningServer(
        create_app(tiny_client, GatewaySettings(api_keys=[{"key": KEY, "role": "admin"}]))
    )
    with httpx.Client(base_url=running.url, timeout=60) as http:
        yield http
    running.stop()


def conversation(http: httpx.Client, turns: int) -> list[dict]:
    """A multi-turn chat sharing its system prompt and history; each turn's response."""
    messages = [{"role": "system", "content": SYSTEM}]
    replies = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question number {turn}?"})
        body = {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0}
        resp = http.post("/v1/chat/completions", json=body, headers=AUTH)
        assert resp.status_code == 200, resp.text
        replies.append(resp.json())
        messages.append(
            {"role": "assistant", "content": replies[-1]["choices"][0]["message"]["content"]}
        )
    return replies


def test_the_page_and_its_json_need_a_key(keyed: httpx.Client) -> None:
    assert_openai_error(keyed.get("/explorer"), 401)
    assert_openai_error(keyed.get("/explorer", params={"key": "wrong"}), 401)
    for path in ("workers", "tree", "requests", "autoscaler"):
        assert_openai_error(keyed.get(f"/debug/explorer/{path}"), 401)
        # the ?key= bootstrap is the page's alone: the JSON takes the header only
        assert_openai_error(keyed.get(f"/debug/explorer/{path}", params={"key": KEY}), 401)
    page = keyed.get("/explorer", params={"key": KEY})
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/debug/explorer/workers" in page.text and "/*EXPLORER_JS*/" not in page.text
    assert page.headers["referrer-policy"] == "no-referrer"
    assert keyed.get("/explorer", headers=AUTH).status_code == 200


def test_the_tree_and_the_requests_show_the_conversation_and_no_prompt_text(
    keyed: httpx.Client,
) -> None:
    replies = conversation(keyed, 3)
    workers = keyed.get("/debug/explorer/workers", headers=AUTH).json()
    [engine] = workers["workers"]
    assert engine["name"] == LOCAL_WORKER and engine["state"] == "up"
    assert engine["tiers"]["device"]["pages_total"] > 0
    assert workers["hit_rate"]["cached"]["total"] > 0 and workers["prompt_text"] is False
    tree = keyed.get("/debug/explorer/tree", params={"worker": LOCAL_WORKER}, headers=AUTH).json()
    shared = max(tree["nodes"], key=lambda n: n["hits"])
    assert shared["hits"] >= 2 and shared["parent_id"] == 0
    ids = {r["id"] for r in replies[1:]}
    assert ids & set(shared["recent_request_ids"]), (ids, shared)
    assert all("text" not in node for node in tree["nodes"])
    listed = keyed.get("/debug/explorer/requests", headers=AUTH).json()["requests"]
    by_id = {r["request_id"]: r for r in listed}
    for reply in replies:
        record = by_id[reply["id"]]
        usage = reply["usage"]
        assert record["status"] == "done"
        assert record["prompt_tokens"] == usage["prompt_tokens"]
        assert record["cached"]["total"] == usage["prompt_tokens_details"]["cached_tokens"]
        assert record["cached"]["device"] == record["cached"]["total"]
        assert record["completion_tokens"] == usage["completion_tokens"]
        assert record["ttft_ms"] > 0 and record["e2e_ms"] >= record["ttft_ms"]
    assert by_id[replies[2]["id"]]["cached"]["total"] > 0
    # each links to its trace, kept by the gateway (tracing is on by default)
    trace_id = by_id[replies[2]["id"]]["trace_id"]
    trace = keyed.get(f"/debug/traces/{trace_id}", headers=AUTH).json()
    assert "gateway.request" in [span["name"] for span in trace["spans"]]
    for word in SECRET.split():  # nothing the explorer serves holds the prompt's text
        for body in (json.dumps(workers), json.dumps(tree), json.dumps(listed)):
            assert word not in body
        assert word not in keyed.get("/explorer", headers=AUTH).text


def test_with_prompt_text_allowed_nodes_show_their_first_words(tiny_client) -> None:
    running = RunningServer(create_app(tiny_client, GatewaySettings(explorer_prompt_text=True)))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            conversation(http, 2)
            tree = http.get("/debug/explorer/tree", params={"worker": LOCAL_WORKER}).json()
    finally:
        running.stop()
    assert tree["prompt_text"] is True
    assert any(SECRET.split()[0] in node["text"] for node in tree["nodes"])


@pytest.mark.parametrize(
    ("params", "status", "param"),
    [
        ({}, 400, "worker"),
        ({"worker": "no-such-worker"}, 404, "worker"),
        ({"worker": LOCAL_WORKER, "nodes": "0"}, 400, "nodes"),
        ({"worker": LOCAL_WORKER, "nodes": "5000"}, 400, "nodes"),
        ({"worker": LOCAL_WORKER, "nodes": "many"}, 400, "nodes"),
    ],
)
def test_bad_tree_parameters_are_refused_by_name(keyed, params, status, param) -> None:
    error = assert_openai_error(keyed.get("/debug/explorer/tree", params=params, headers=AUTH),
                                status)  # fmt: skip
    assert error["param"] == param


def test_bad_request_limits_are_refused_by_name(keyed: httpx.Client) -> None:
    resp = keyed.get("/debug/explorer/requests", params={"limit": "-1"}, headers=AUTH)
    assert assert_openai_error(resp, 400)["param"] == "limit"


def test_no_autoscaler_says_so(keyed: httpx.Client) -> None:
    assert keyed.get("/debug/explorer/autoscaler", headers=AUTH).json() == {"autoscaler": None}


class _ProbeThread:
    """An autoscaler's HTTP side (its real `ProbeServer`) on a loop of its own thread."""

    def __init__(self, service: AutoscalerService) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(service.probe.start(), self.loop).result(10)
        self.service = service

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.service.probe.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)


def test_the_autoscalers_recent_decisions_are_shown_with_their_reasons(tiny_client) -> None:
    from radixserve.metrics import ServingMetrics

    settings = AutoscalerSettings(ttft_p90_target_s=1.0, cold_start_s=0, min_prefill=1,
                                  max_prefill=4, port=0, host="127.0.0.1")  # fmt: skip
    m = ServingMetrics()
    short = [(1000, 0.0)] * 20
    texts = [exposition(m, 2.5, short), exposition(m, 5.0, short + [(20000, 0.0)])]
    service = AutoscalerService(settings, source=_Scrapes(texts), connector=DryRunConnector())
    service.tick()  # the baseline
    decided = service.tick()
    probe = _ProbeThread(service)
    running = RunningServer(create_app(tiny_client, GatewaySettings(
        autoscaler_url=f"http://127.0.0.1:{service.probe.port}")))  # fmt: skip
    try:
        shown = httpx.get(f"{running.url}/debug/explorer/autoscaler", timeout=10).json()
    finally:
        running.stop()
        probe.stop()
    body = shown["autoscaler"]
    assert body["connector"] == service.connector.name
    assert {d["role"]: d["reason"] for d in body["latest"]} == {d.role: d.reason for d in decided}
    recent = {(d.role, d.reason) for d in decided if d.kind != "steady"}
    assert {(d["role"], d["reason"]) for d in body["recent"]} == recent
    assert any(d["advice"] for d in body["latest"])  # the infeasible prompt's remedies


def test_a_clusters_workers_in_the_explorer_debug_cache_and_metrics(
    tiny_client, monkeypatch
) -> None:
    """Each worker's typed heartbeat, as the explorer groups it, /debug/cache flattens
    it and /metrics exports it (the views a cluster gateway holds, `cluster_views`)."""
    monkeypatch.setattr(tiny_client, "worker_stats", cluster_views)
    running = RunningServer(create_app(tiny_client, GatewaySettings()))
    try:
        with httpx.Client(base_url=running.url, timeout=60) as http:
            listed = http.get("/debug/explorer/workers").json()["workers"]
            debug = http.get("/debug/cache").json()["workers"]
            metrics = http.get("/metrics").text
    finally:
        running.stop()
    shown = {w.pop("name"): w for w in listed}
    assert list(shown) == ["decode-0", "kvstore", "prefill-0", "prefill-1"]
    for entry in shown.values():
        del entry["hit_rate"], entry["live"]
    assert shown["decode-0"] == {
        "role": "decode", "state": "up", "address": "tcp://d:1", "tp_size": 2,
        "tiers": {"device": {"pages_total": 100, "pages_used": 40, "pages_free": 60,
                             "pages_cached": 30, "pages_locked": 4, "pages_evictable": 26,
                             "page_bytes": 4096, "live_requests": 2}},
        "load": {"running": 2, "waiting": 1, "queued_tokens": 5, "gateway_in_flight": 1},
        "audit": {"audit_checked": 10, "audit_mismatches": 1, "audit_fail_closed": 0},
        "speculation": {"prompt": {"steps": 10, "drafted": 40, "accepted": 30,
                                   "acceptance": 0.75, "tokens_per_step": 4.0}},
    }  # fmt: skip
    assert shown["kvstore"] == {
        "role": "kvstore", "state": "up", "address": "tcp://k:1", "tp_size": 0,
        "tiers": {"host": {"total": 64, "used": 8, "free": 56, "stored": 8, "leased": 1},
                  "disk": {"total": 1000, "used": 10, "free": 990, "stored": 10, "leased": 0}},
        "load": {"running": 0, "waiting": 0, "queued_tokens": 0}, "audit": {},
        "speculation": {},
    }  # fmt: skip
    assert shown["prefill-0"]["tiers"]["device"] == {
        "pages_total": 50, "pages_used": 0, "pages_free": 0, "live_requests": 0,
    }  # fmt: skip
    assert shown["prefill-1"] == {"role": "prefill", "state": "down", "address": "tcp://p:2",
                                  "tp_size": 1, "tiers": {}, "load": {}, "audit": {},
                                  "speculation": {}}  # fmt: skip
    assert debug == {name: view.as_dict() for name, view in cluster_views().items()}
    assert debug["decode-0"]["pages_used"] == 40 and debug["kvstore"]["members"] == 3
    assert 'radixserve_worker_pages_used{role="decode",worker="decode-0"} 40.0' in metrics
    assert 'radixserve_kv_identity_mismatch_total{role="kvstore",worker="kvstore"} 4.0' in metrics
