"""The kvstore's host-memory tier on the real cluster (processes, NIXL or ZMQ, HTTP).

The clusters serve the tiny model (the `tiny_model` fixture): the subject is the
machinery (eviction, spill, host loads, the tier's bound), which the model's size does
not change, and its answers are compared with the same weights run in one process. The
tiny model reads the same tokenizer, so prompts fill the same pages; a page is 8 KiB
against the default model's 720 KiB, so the pools are sized in pages (`gib`), and each
test checks the sizes the workers report. Answers are 16 tokens (`MAX_TOKENS`), long
enough that no two conversations' answers are the same.

* A device pool too small for every conversation: returning to an evicted one loads its
  prefix from the host tier (``tier="host"`` hits, pages read by the workers) instead of
  recomputing it, and the answer is the single-process engine's.
* Cross-worker reuse (a system prompt computed on one prefill worker, loaded from the
  host tier by the other) is test_host_tier_reuse.py.
* A bounded load with a host tier smaller than the conversations, over a disk tier in
  the test's tmp directory: the host tier stays within its capacity (evicting to disk),
  prefixes come back device -> host -> disk and back, answers do not change with the
  tiers (the engine's defaults), and afterwards no lease, no host page reader, no
  disk read and no spill buffer page is left held.

The two tests keep a cluster each: the first needs a host tier that holds the evicted
conversation, the second one smaller than the conversations, and they cover the host
tier over both transports (NIXL, ZMQ).
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.engine.device import resolve_dtype
from tests.cluster.cluster_helpers import TestCluster, index_query, metric_value
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat
from tests.engine.engine_helpers import tiny_checkpoint
from tests.gateway.lora_helpers import write_adapters

#: answers long enough to tell every conversation's apart: the random model's first tokens
#: hardly depend on the prompt (at 8 tokens, three of the capacity test's six conversations
#: read the same; from the 12th token on, each reads its own)
MAX_TOKENS = 16
PAGE = 16
#: one page of the tiny model's KV in the default dtype, as the engine computes it
PAGE_BYTES = KVPool.page_bytes_all_layers(
    tiny_checkpoint().config, PAGE, resolve_dtype("auto", torch.device("cpu"))
)
DEVICE_PAGES = 36  # each worker's pool: room for two of these prompts (17 full pages each)
HOST_PAGES = 29  # the capacity test's host tier: less than the conversations


def gib(pages: int) -> float:
    """A budget in GiB of ``pages`` of the tiny model's pages (and half a page, so that
    its decimal form, which the workers parse, still rounds down to them)."""
    return (pages + 0.5) * PAGE_BYTES / (1 << 30)


def tiers_env(host_pages: int, disk_dir: Path, disk_pages: int) -> dict[str, str]:
    """The kvstore's settings for a host tier of ``host_pages`` over a disk tier of
    ``disk_pages`` in ``disk_dir``."""
    return {"HOST_CAPACITY_GIB": str(gib(host_pages)), "DISK_TIER_DIR": str(disk_dir),
            "DISK_TIER_GIB": str(gib(disk_pages))}  # fmt: skip


def assert_pools(cluster: TestCluster, pages: int) -> None:
    """Every engine's pool is ``pages`` pages of the tiny model's, as the worker states
    (in its stats, which reach the gateway with a heartbeat after the worker is up)."""
    engines: dict[str, dict] = {}

    def reported() -> bool:
        nonlocal engines
        engines = {n: w for n, w in cluster.workers().items() if "pages_total" in w}
        return len(engines) == 2

    cluster.wait(reported, 10, "both engines' pool sizes at the gateway")
    for name, worker in engines.items():
        assert (worker["page_bytes"], worker["pages_total"]) == (PAGE_BYTES, pages), name


def branch_system(i: int) -> str:
    """A system prompt (about 280 tokens, 17 pages) that differs from the first page on."""
    return f"You answer for branch number {i} of the library. " + SYSTEM


def cached(answer: dict) -> int:
    return int(answer["usage"]["prompt_tokens_details"]["cached_tokens"])


def host_hits(cluster: TestCluster) -> float:
    return metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="host")


def test_an_evicted_conversation_comes_back_from_the_host_tier(
    tiny_model, tiny_reference_chat, tmp_path
):
    """... and only to its own weights: the same conversation with a LoRA adapter that
    both workers serve finds none of the base model's host-tier pages."""
    pytest.importorskip("peft")
    [adapter] = write_adapters(Path(tiny_model), tmp_path, ("qv",)).values()
    cluster = TestCluster(
        transport="nixl",
        model=tiny_model,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0"},  # the prefill worker computes every prompt
        kv_cache_memory_gib=gib(DEVICE_PAGES),
        env={"RADIXSERVE_LORA_MODULES": json.dumps([f"qv={adapter}"])},  # every worker
    )
    try:
        assert_pools(cluster, DEVICE_PAGES)
        cluster.wait_host_tier()  # spills before the attach would be dropped
        first = cluster.ask(chat(QUESTIONS[0], branch_system(0)), MAX_TOKENS)
        prompt = first["usage"]["prompt_tokens"]
        assert cached(first) == 0
        for i in range(1, 4):  # three more conversations push the first out of every pool
            cluster.ask(chat(QUESTIONS[i], branch_system(i)), MAX_TOKENS)
        full_pages = (prompt - 1) // PAGE
        ids = tiny_checkpoint().tokenizer.encode_chat(chat(QUESTIONS[0], branch_system(0)))

        def spilled() -> bool:  # the index sees it in the host tier, on no device
            reply = index_query(cluster, ids[: full_pages * PAGE])
            return reply is not None and reply.host_pages == full_pages and not reply.device_pages

        cluster.wait(spilled, 10, "the first conversation to be only in the host tier")
        before = host_hits(cluster)
        body = {"model": "qv", "messages": chat(QUESTIONS[0], branch_system(0)),
                "max_tokens": MAX_TOKENS, "temperature": 0}  # fmt: skip
        other = cluster.http.post("/v1/chat/completions", json=body)
        assert other.status_code == 200, other.text
        assert cached(other.json()) == 0 and host_hits(cluster) == before  # not its pages
        assert other.json()["choices"][0]["message"]["content"] != first["choices"][0][
            "message"]["content"]  # fmt: skip
        cluster.wait(spilled, 10, "the base model's pages to be in the host tier still")

        again = cluster.ask(chat(QUESTIONS[0], branch_system(0)), MAX_TOKENS)
        assert cached(again) == full_pages * PAGE  # all of it from the host tier
        assert host_hits(cluster) - before == full_pages * PAGE
        text = again["choices"][0]["message"]["content"]
        assert text == first["choices"][0]["message"]["content"]
        assert text == tiny_reference_chat(chat(QUESTIONS[0], branch_system(0)), MAX_TOKENS)
        assert_host_load_span(cluster, again["id"], full_pages)
        cluster.wait(
            lambda: cluster.workers()["prefill-0"].get("host_load_pages_total", 0) >= full_pages,
            10,
            "prefill-0 to report the pages it loaded",
        )
        assert cluster.workers()["prefill-0"].get("host_load_failures_total", 0) == 0
        # the adapter's own pages spill and come back too, under its own names, and give
        # the answer it computed without them
        for i in range(4, 7):
            cluster.ask(chat(QUESTIONS[i], branch_system(i)), MAX_TOKENS)
        fingerprint = cluster.workers()["decode-0"]["loras"]["qv"]

        def adapter_spilled() -> bool:
            reply = index_query(cluster, ids[: full_pages * PAGE], adapter=fingerprint)
            return reply is not None and reply.host_pages == full_pages and not reply.device_pages

        cluster.wait(adapter_spilled, 10, "the adapter's conversation to be only in the host tier")
        before = host_hits(cluster)
        back = cluster.http.post("/v1/chat/completions", json=body)
        assert back.status_code == 200, back.text
        assert cached(back.json()) == full_pages * PAGE
        assert host_hits(cluster) - before == full_pages * PAGE
        assert back.json()["choices"][0]["message"] == other.json()["choices"][0]["message"]
        cluster.wait_clean()
    finally:
        cluster.stop()


def assert_host_load_span(cluster: TestCluster, request_id: str, pages: int) -> None:
    """The request's trace (the gateway's /debug/traces) has the prefill worker's
    host-tier load, read, under its own span of that request."""
    listed = cluster.http.get("/debug/traces", params={"limit": 50}).json()["traces"]
    [summary] = [t for t in listed if t["request_id"] == request_id]
    spans = cluster.http.get(f"/debug/traces/{summary['trace_id']}").json()["spans"]
    [load] = [s for s in spans if s["name"] == "prefill.host_load"]
    parent = {s["span_id"]: s for s in spans}[load["parent_span_id"]]
    assert load["service"] == parent["service"] == "prefill", (load, parent)
    assert load["attributes"]["host_pages"] == pages and load["attributes"]["read"], load
    assert parent["start_ns"] <= load["start_ns"] <= load["end_ns"] <= parent["end_ns"]


def disk_hits(cluster: TestCluster) -> float:
    return metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk")


def test_the_host_tier_stays_within_capacity_under_load_and_leaks_nothing(
    tiny_model, tiny_reference_chat, tmp_path
):
    cluster = TestCluster(
        transport="zmq",
        model=tiny_model,
        kv_cache_memory_gib=gib(DEVICE_PAGES),
        kvstore=tiers_env(HOST_PAGES, tmp_path, 8 * HOST_PAGES),
        gateway={"MAX_QUEUED_REQUESTS": "64"},
        # the tiny model computes a prompt in milliseconds: a busy machine must not turn
        # the tiers' lookups into timeouts (the subject here is where pages go, and exactness)
        prefill={"HOST_LOOKUP_TIMEOUT_S": "5"},
        decode={"HOST_LOOKUP_TIMEOUT_S": "5"},
    )
    try:
        assert_pools(cluster, DEVICE_PAGES)
        cluster.wait_host_tier()
        conversations = [chat(QUESTIONS[i % len(QUESTIONS)], branch_system(i)) for i in range(6)]
        with ThreadPoolExecutor(3) as pool:
            rounds = [
                list(pool.map(lambda m: cluster.ask(m, MAX_TOKENS), conversations))
                for _ in range(2)
            ]
        texts = [[a["choices"][0]["message"]["content"] for a in r] for r in rounds]
        assert texts[0] == texts[1]  # whichever tier served the second round
        for i in (0, 5):
            assert texts[0][i] == tiny_reference_chat(conversations[i], MAX_TOKENS)
        # one at a time, nothing evicts a prefix between its load and its step: the
        # conversations not on a device come back from host memory or from disk
        before = disk_hits(cluster)
        again = [cluster.ask(m, MAX_TOKENS) for m in conversations]
        assert [a["choices"][0]["message"]["content"] for a in again] == texts[0]
        assert disk_hits(cluster) > before  # device -> host -> disk and back, same answers
        deadline = time.monotonic() + 30
        while True:
            workers = cluster.workers()
            store = workers["kvstore"]
            buffers = [w for n, w in workers.items() if n != "kvstore" and "host_attached" in w]
            idle = all(w["host_spill_buffer_free"] == w["host_spill_buffer_pages"] for w in buffers)
            idle = idle and store["host_leases"] == store["disk_leases"] == 0  # lookups ended
            if idle or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert idle, "spill buffers or host-tier leases still held"
        assert len(buffers) == 2
        # every page read (over ZMQ: grants enforced) was one lent to its reader
        assert workers["decode-0"]["remote_prefills_total"] > 0  # prefill-0's leased pages
        assert store["host_stored_pages_total"] > 0  # read from the buffer pages on offer
        for w in workers.values():
            assert w.get("kv_transfer_refused_reads_total", 0) == 0, w
            assert w.get("host_spill_refused_reads_total", 0) == 0, w
        page_bytes = workers["decode-0"]["page_bytes"]  # the engine's geometry, as it states it
        assert store["host_pages_total"] == int(gib(HOST_PAGES) * (1 << 30)) // page_bytes
        assert store["host_pages_total"] == HOST_PAGES and page_bytes == PAGE_BYTES
        assert store["host_pages_used"] <= store["host_pages_total"]
        assert store["host_stored_pages_total"] > store["host_pages_total"]
        assert store["host_evictions_total"] > 0  # the bound was reached and held
        assert store["host_leases"] == 0 and store["host_pages_leased"] == 0
        assert store["disk_tier_up"] == 1 and store["disk_write_pages_total"] > 0
        assert store["disk_hit_pages_total"] > 0 and store["disk_corrupt_pages_total"] == 0
        assert store["disk_bytes_total"] <= store["disk_bytes_bound"]
        assert store["disk_leases"] == 0
        cluster.wait_clean()
    finally:
        cluster.stop()
