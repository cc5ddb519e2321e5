"""Faults and overload on the real cluster (processes, NIXL, HTTP) end cleanly: every
test ends with no live request, no locked page, no lease and no task on the workers that
are up (`/debug/cache`). The cluster serves the tiny model (the `tiny_model` fixture):
the subject is the machinery, and its answers are compared with the same weights run in
one process.

- a client that disconnects mid-stream, or while its prompt is on the prefill worker,
  has its request aborted on the decode and the prefill worker;
- `kill -9` of the only decode worker mid-stream: the stream continues once the
  supervisor has restarted it, with the uninterrupted answer's text; a streamed tool
  call continues its arguments there and reassembles to the uninterrupted call;
- `kill -9` of the prefill worker while it holds a request: the decode worker recomputes
  the prompt itself (``on_transfer_failure=recompute``) and the answer is still exact;
- 64 concurrent streams complete with the single-process answers; with 64 in flight,
  requests over the bound are refused at once (429), not queued, and when those 64
  clients hang up, nothing is left held.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time

import httpx
import jsonschema

from tests.cluster.cluster_helpers import TestCluster, metric_value
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

SHARED_CLUSTER = "remote-tiny"  # tests/cluster/conftest.py


def long_chat(tag: str) -> list[dict[str, str]]:
    """About 6,600 prompt tokens nobody has cached: over half a second of the tiny model's
    prefill on one thread, several heartbeats of the prefill worker's."""
    return chat("Which floor is quiet?", system=f"[{tag}] " + SYSTEM * 26)


def stream_body(messages, max_tokens: int) -> dict:
    return {
        "model": "default",
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }


def wait_for(cluster: TestCluster, worker: str, key: str, at_least: int, timeout_s: float = 60):
    cluster.wait(
        lambda: cluster.workers()[worker].get(key, 0) >= at_least,
        timeout_s,
        f"{worker} {key} >= {at_least}",
    )


def test_client_disconnect_mid_stream_aborts_the_request(cluster):
    cluster.wait_clean()
    body = stream_body(chat("Hi"), 500)
    with cluster.http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        content = 0
        for line in r.iter_lines():
            if '"content":"' in line and '"content":""' not in line:
                content += 1
            if content >= 3:
                break  # leave mid-stream: the connection closes here
    state = cluster.wait_clean()
    assert state["workers"]["decode-0"]["live_requests"] == 0


def test_client_disconnect_during_remote_prefill_aborts_it_on_the_prefill_worker(cluster):
    cluster.wait_clean()
    # a raw connection: send the request, then hang up while the prefill worker works
    body = json.dumps(stream_body(long_chat("leave"), 50)).encode()
    host, port = cluster.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        wait_for(cluster, "prefill-0", "tasks", 1, timeout_s=30)
    state = cluster.wait_clean(60)
    prefill = state["workers"]["prefill-0"]
    assert prefill["tasks"] == 0 and prefill["leases"] == 0 and prefill["pages_locked"] == 0


def test_kill_9_of_the_only_decode_worker_mid_stream_continues_after_its_restart(cluster):
    """With one decode worker, a stream outlives its kill: the gateway waits for the
    supervisor's restart (migration_wait_s) and continues the stream there, its text the
    uninterrupted answer's."""
    cluster.wait_clean()
    old_generation = cluster.workers()["decode-0"]["generation"]
    events: list[dict] = []
    body = stream_body(chat("Tell me a story about a library."), 300)  # seconds of stream

    def read() -> None:
        with cluster.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))

    reader = threading.Thread(target=read)
    reader.start()
    cluster.wait(lambda: len(events) >= 4, 120, "the stream under way")
    os.kill(cluster.supervisor.pid("decode-0"), signal.SIGKILL)
    cluster.wait_restarted("decode-0", old_generation)  # the supervisor runs on this thread
    reader.join(180)
    assert not reader.is_alive() and events
    assert not any("error" in e for e in events), events[-1]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert cluster.supervisor.restarts["decode-0"] >= 1
    assert cluster.workers()["decode-0"]["generation"] != old_generation
    resp = cluster.http.post("/v1/chat/completions", json={**body, "stream": False})
    assert resp.status_code == 200, resp.text
    assert text == resp.json()["choices"][0]["message"]["content"]
    cluster.wait_clean()


NOTE = {  # a call whose arguments take the tiny model hundreds of tokens to write
    "type": "function",
    "function": {"name": "note", "parameters": {
        "type": "object", "properties": {"text": {"type": "string", "minLength": 1200,
                                                 "maxLength": 1400}},
        "required": ["text"], "additionalProperties": False}},
}  # fmt: skip


def test_kill_9_mid_tool_call_continues_the_call(cluster):
    """A stream carrying a forced tool call outlives its decode worker's kill: the call's
    argument fragments continue on the restarted worker (the gateway's parser keeps its
    state), and they reassemble to the uninterrupted call, valid against its schema."""
    cluster.wait_clean()
    old_generation = cluster.workers()["decode-0"]["generation"]
    migrations = lambda: metric_value(cluster.http.get("/metrics").text,  # noqa: E731
                                      "radixserve_migrations_total")  # fmt: skip
    migrated_before = migrations()
    body = {"model": "default", "messages": chat("Take a note."), "tools": [NOTE],
            "tool_choice": {"type": "function", "function": {"name": "note"}},
            "max_tokens": 2000, "temperature": 0, "stream": True}  # fmt: skip
    deltas: list[dict] = []
    errors: list[dict] = []

    def read() -> None:
        with cluster.http.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    (errors if "error" in event else deltas).append(event)

    reader = threading.Thread(target=read)
    reader.start()
    fragments = lambda: [d for d in deltas for c in d["choices"]  # noqa: E731
                         for tc in c["delta"].get("tool_calls") or () if "id" not in tc]  # fmt: skip
    deadline = time.monotonic() + 120
    while len(fragments()) < 4:  # polled closely: the tiny model writes fast
        assert time.monotonic() < deadline and reader.is_alive(), "no arguments streamed"
        time.sleep(0.005)
    os.kill(cluster.supervisor.pid("decode-0"), signal.SIGKILL)
    before_kill = len(fragments())
    cluster.wait_restarted("decode-0", old_generation)
    reader.join(180)
    assert not reader.is_alive() and not errors, errors
    calls: dict[int, dict] = {}  # reassembled as the OpenAI SDK does
    for d in deltas:
        for tc in d["choices"][0]["delta"].get("tool_calls") or ():
            call = calls.setdefault(tc["index"], {"name": "", "arguments": ""})
            call["name"] += tc["function"].get("name") or ""
            call["arguments"] += tc["function"].get("arguments") or ""
    assert deltas[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert len(fragments()) > before_kill and migrations() == migrated_before + 1
    (call,) = calls.values()
    jsonschema.validate(json.loads(call["arguments"]), NOTE["function"]["parameters"])
    whole = cluster.http.post("/v1/chat/completions", json={**body, "stream": False})
    assert whole.status_code == 200, whole.text
    (expected,) = whole.json()["choices"][0]["message"]["tool_calls"]
    assert call == {"name": "note", "arguments": expected["function"]["arguments"]}
    cluster.wait_clean()


def test_kill_9_prefill_mid_request_recomputes_on_decode(cluster, tiny_reference_chat):
    cluster.wait_clean()
    old_generation = cluster.workers()["prefill-0"]["generation"]
    failures_before = cluster.workers()["decode-0"].get("remote_prefill_failures_total", 0)
    messages = long_chat("kill")
    body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
    result: dict = {}

    def request() -> None:
        result["resp"] = cluster.http.post("/v1/chat/completions", json=body)

    thread = threading.Thread(target=request)
    thread.start()
    try:
        wait_for(cluster, "prefill-0", "tasks", 1, timeout_s=30)
        os.kill(cluster.supervisor.pid("prefill-0"), signal.SIGKILL)
    finally:
        thread.join(timeout=180)
    resp = result["resp"]
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == tiny_reference_chat(messages, 8)
    cluster.wait_restarted("prefill-0", old_generation)
    state = cluster.wait_clean()
    assert state["workers"]["decode-0"]["remote_prefill_failures_total"] > failures_before


async def _stream_chat(client: httpx.AsyncClient, messages, max_tokens: int) -> tuple[int, str]:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    text = []
    async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, resp.text
        async for line in resp.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                if event["choices"]:
                    text.append(event["choices"][0]["delta"].get("content") or "")
    return 200, "".join(text)


def test_64_concurrent_streams_complete_and_overload_is_refused_fast(cluster, tiny_reference_chat):
    conversations = [chat(QUESTIONS[i % len(QUESTIONS)]) for i in range(64)]

    async def burst(messages_list, max_tokens):
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300, limits=limits) as client:
            return await asyncio.gather(
                *(_stream_chat(client, m, max_tokens) for m in messages_list)
            )

    # 12 tokens: the tiny model's first few tokens barely depend on the prompt; by the
    # twelfth the eight questions' answers all differ, so a mixed-up stream shows
    results = asyncio.run(burst(conversations, 12))
    for messages, (status, text) in zip(conversations, results):
        assert status == 200
        assert text == tiny_reference_chat(messages, 12)
    cluster.wait_clean(60)

    # over the bound (64 in flight): the surplus is refused at once with 429; then the 64
    # clients hang up mid-stream, and every worker lets go of their requests
    async def hold(client: httpx.AsyncClient, messages, statuses: list[int]) -> None:
        body = {"model": "default", "messages": messages, "max_tokens": 4000,
                "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            statuses.append(resp.status_code)
            await asyncio.Event().wait()  # until cancelled: the connection closes

    async def overload():
        loop = asyncio.get_running_loop()
        limits = httpx.Limits(max_connections=256, max_keepalive_connections=0)
        statuses: list[int] = []
        async with httpx.AsyncClient(base_url=cluster.url, timeout=300, limits=limits) as client:
            held = [asyncio.create_task(hold(client, chat(QUESTIONS[i % 8]), statuses))
                    for i in range(64)]  # fmt: skip
            deadline = loop.time() + 60
            while (await client.get("/debug/cache")).json()["gateway_in_flight"] < 64:
                assert loop.time() < deadline, "the 64 streams were never all in flight"
                await asyncio.sleep(0.02)  # until the 64 are admitted
            started = loop.time()
            extra = await asyncio.gather(*(_stream_chat(client, chat("Hi"), 4) for _ in range(8)))
            refused_in = loop.time() - started
            while len(statuses) < 64:  # every held stream under way
                assert loop.time() < deadline, f"{len(statuses)} of 64 streams began"
                await asyncio.sleep(0.02)
            for task in held:
                task.cancel()
            await asyncio.gather(*held, return_exceptions=True)
            return extra, refused_in, statuses

    extra, refused_in, statuses = asyncio.run(overload())
    assert all(status == 429 for status, _ in extra), extra
    assert '"rate_limit_error"' in extra[0][1]
    assert refused_in < 5.0  # refused, not queued behind the running requests
    assert statuses == [200] * 64
    cluster.wait_clean(60)
