"""Cache isolation through `radixserve up`'s processes (the tiny model, two decode workers,
no prefill worker, so each request's KV is computed and cached on its decode worker), as
a client with API keys sees it: tenant A (two keys) and tenant B.

- B sending A's long system prompt, served by the very worker that caches A's pages,
  sees ``cached_tokens`` 0, while A's second key sees the prefix cached;
- two requests of one tenant with different ``cache_salt`` share nothing, with the same
  one they share;
- requests sent together with one ``prompt_cache_key`` land on the same decode worker,
  where without it (other keys) load spreads them over both. Which worker served a
  request is read from the explorer's request list (the admin's)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.cluster.cluster_helpers import PATIENT, TestCluster, stopped
from tests.cluster.prompts import SYSTEM

A1 = "tenant-a-first-key-0123456789"
A2 = "tenant-a-second-key-0123456789"
B = "tenant-b-only-key-0123456789"
ADMIN = "cluster-admin-key-0123456789"
DECODERS = ("decode-0", "decode-1")


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def cluster(tiny_model: str) -> Iterator[TestCluster]:
    keys = [{"key": A1, "tenant": "tenant-a", "role": "user"},
            {"key": A2, "tenant": "tenant-a", "role": "user"},
            {"key": B, "tenant": "tenant-b", "role": "user"},
            {"key": ADMIN, "tenant": "ops", "role": "admin"}]  # fmt: skip
    cluster = TestCluster(transport="zmq", num_prefill=0, num_decode=2, model=tiny_model,
                          decode=PATIENT, kvstore=PATIENT,
                          gateway={"API_KEYS": json.dumps(keys), **PATIENT})  # fmt: skip
    yield cluster
    cluster.stop()


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "default", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}


def served(cluster: TestCluster, key: str, body: dict[str, Any]) -> tuple[int, str]:
    """Send ``body`` with ``key``: (its cached tokens, the decode worker that served it)."""
    resp = cluster.http.post("/v1/chat/completions", json=body, headers=auth(key))
    assert resp.status_code == 200, resp.text
    reply = resp.json()
    cluster.wait_clean()
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"], worker_of(cluster, reply["id"])


def worker_of(cluster: TestCluster, request_id: str) -> str:
    listed = cluster.http.get("/debug/explorer/requests", headers=auth(ADMIN))
    assert listed.status_code == 200, listed.text
    [record] = [r for r in listed.json()["requests"] if r["request_id"] == request_id]
    return str(record["decode_worker"])


def test_another_tenant_never_hits_a_tenants_cache(cluster: TestCluster) -> None:
    body = chat("Tenant A's assistant. " + SYSTEM, "When do you open on Saturday?")
    first, worker = served(cluster, A1, body)
    other_tenant, other_worker = served(cluster, B, body)
    same_tenant, same_worker = served(cluster, A2, body)
    assert first == 0
    assert other_worker == worker  # on the worker holding A's pages (idle: the tie-break)
    assert other_tenant == 0  # ... which B's request never reaches
    assert same_worker == worker and same_tenant >= 256  # A's other key: the prefix cached


def test_a_cache_salt_shares_only_with_the_same_salt(cluster: TestCluster) -> None:
    system = "Tenant A's salted assistant. " + SYSTEM
    salted = chat(system, "Can I renew a book online?", cache_salt="conversation-1")
    assert served(cluster, A1, salted)[0] == 0
    assert served(cluster, A2, {**salted, "cache_salt": "conversation-2"})[0] == 0
    assert served(cluster, A2, salted)[0] >= 256
    assert served(cluster, B, salted)[0] == 0  # the same salt, another tenant


def test_one_prompt_cache_key_lands_on_one_decode_worker(cluster: TestCluster) -> None:
    """Two new conversations sent together (the decode workers stopped until both are
    routed): with one prompt_cache_key both go to one worker; with two keys, the second
    goes to the idle worker."""

    def together(keys: tuple[str, str]) -> list[str]:
        bodies = [chat(f"Conversation {key}, turn {i}. " + SYSTEM, "When is story time?",
                       prompt_cache_key=key) for i, key in enumerate(keys)]  # fmt: skip
        replies = asyncio.run(_send_routed_together(cluster, bodies))
        cluster.wait_clean()
        return [worker_of(cluster, reply["id"]) for reply in replies]

    assert len(set(together(("ticket-1", "ticket-1")))) == 1
    assert sorted(together(("ticket-2", "ticket-3"))) == sorted(DECODERS)


async def _send_routed_together(cluster: TestCluster, bodies: list[dict]) -> list[dict]:
    async with httpx.AsyncClient(base_url=cluster.url, timeout=120, headers=auth(A1)) as client:
        with stopped(cluster, DECODERS):
            posts = [
                asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
                for body in bodies
            ]
            deadline = time.monotonic() + 30
            while True:  # until the gateway has routed every request
                workers = (await client.get("/debug/cache", headers=auth(ADMIN))).json()["workers"]
                if sum(workers[n]["gateway_in_flight"] for n in DECODERS) == len(bodies):
                    break
                assert time.monotonic() < deadline, workers
                await asyncio.sleep(0.02)
        replies = await asyncio.gather(*posts)
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json() for r in replies]
