"""Cache-aware prefill routing through the real gateway and kvstore: with two prefill
workers, a shared system prompt is computed once cluster-wide while requests come one
at a time (they go where the prefix is cached), and a concurrent burst spreads over both
workers once the queue on the caching one costs more than recomputing the prefix.

The cluster serves the tiny model (the shared ``two-prefill-tiny`` cluster): the subject
is the routing, not the model's text. The tiny model computes a prompt in milliseconds,
so the burst is made concurrent by construction rather than by the model's slowness:
the prefill workers are stopped (SIGSTOP) until the decode worker has sent every prompt
of the burst, so each is routed with the earlier ones still queued.

The cluster is shared with test_host_tier_reuse (prefixes written through to the host
tier): counters are read as deltas."""

from __future__ import annotations

import asyncio

import httpx

from tests.cluster.cluster_helpers import (
    TestCluster,
    index_query,
    metric_value,
    stopped,
    wait_workers,
)
from tests.cluster.prompts import QUESTIONS, chat
from tests.engine.engine_helpers import tiny_checkpoint

SHARED_CLUSTER = "two-prefill-tiny"  # shared with other modules: tests/cluster/conftest.py
PREFILLS = ("prefill-0", "prefill-1")


def prefill_counter(cluster: TestCluster, key: str) -> dict[str, float]:
    workers = cluster.workers()
    return {name: workers[name].get(key, 0) for name in PREFILLS}


def delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {name: now[name] - before[name] for name in now}


def _prefill_holding(cluster: TestCluster, prompt_ids: list[int]) -> bool:
    """Whether the kvstore's index has a prefill worker holding all of ``prompt_ids``."""
    reply = index_query(cluster, prompt_ids)
    pages = len(prompt_ids) // 16
    return reply is not None and any(reply.device_pages.get(n, 0) >= pages for n in PREFILLS)


def test_shared_prefix_is_computed_once_then_load_spreads_it(cluster):
    cluster.wait_clean()
    computed_before = prefill_counter(cluster, "prefill_computed_tokens_total")
    served_before = prefill_counter(cluster, "prefill_requests_total")
    gateway_before = metric_value(cluster.metrics(), "radixserve_prefill_computed_tokens_total")
    prompts = [tiny_checkpoint().tokenizer.encode_chat(chat(q)) for q in QUESTIONS[:4]]
    shared = 256  # the pages all four prompts share (16 full pages)
    for i, question in enumerate(QUESTIONS[:4]):  # one at a time
        body = {"messages": chat(question), "max_tokens": 4, "temperature": 0}
        assert cluster.http.post("/v1/chat/completions", json=body).status_code == 200
        # one at a time means after the last has settled: the workers' heartbeats (their
        # queued tokens) are fresh, and the kvstore's index knows where the first put
        # the shared pages (its events race the next request otherwise)
        cluster.wait_clean()
        if i == 0:
            cluster.wait(lambda: _prefill_holding(cluster, prompts[0][:shared]), 30,
                         "the index to learn the first prompt's pages")  # fmt: skip
    computed = delta(prefill_counter(cluster, "prefill_computed_tokens_total"), computed_before)
    served = delta(prefill_counter(cluster, "prefill_requests_total"), served_before)
    # all four went to the worker that cached the system prompt on the first request ...
    assert sorted(served.values()) == [0, 4]
    # ... so the system prompt was computed once: the first prompt whole, then deltas
    assert sum(computed.values()) == sum(len(p) for p in prompts) - 3 * shared
    gateway_computed = metric_value(cluster.metrics(), "radixserve_prefill_computed_tokens_total")
    assert gateway_computed - gateway_before == sum(computed.values())

    # a concurrent burst: the caching worker's queue soon outweighs its cache hit
    bodies = [
        {"messages": chat(f"{QUESTIONS[i % 8]} (visitor {i})"), "max_tokens": 4,
         "temperature": 0}
        for i in range(6)
    ]  # fmt: skip

    async def burst():
        async with httpx.AsyncClient(base_url=cluster.url, timeout=120) as client:
            with stopped(cluster, PREFILLS):  # until every prompt is sent to one of them
                posts = [
                    asyncio.ensure_future(client.post("/v1/chat/completions", json=b))
                    for b in bodies
                ]
                await wait_workers(
                    client,
                    lambda w: w["decode-0"].get("awaiting_kv", 0) == len(bodies),
                    "the decode worker to send every prompt to a prefill worker",
                )
            return await asyncio.gather(*posts)

    replies = asyncio.run(burst())
    assert all(r.status_code == 200 for r in replies)
    cluster.wait_clean()
    after = delta(prefill_counter(cluster, "prefill_requests_total"), served_before)
    assert all(after[name] > served[name] for name in after), (served, after)
