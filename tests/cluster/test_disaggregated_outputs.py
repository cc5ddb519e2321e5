"""The real cluster (gateway, prefill and decode processes) answers exactly like one
process: greedy outputs through HTTP equal the single-process engine's with remote
prefill over NIXL; the official `openai` client works; a second chat turn reuses the
first and moves only the missing pages; bad input gets an OpenAI error. (64 concurrent
streams and the overload bound are test_faults', on the tiny model.)

Cluster "remote" forces every prefill onto the prefill worker
(``local_prefill_max_tokens=0``). The decode worker's own choice between remote and
local prefill, over ZMQ, is test_local_prefill's.
"""

from __future__ import annotations

import json
import uuid

import openai
import pytest

from tests.cluster.cluster_helpers import TestCluster, metric_value
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 12
PAGE = 16


SHARED_CLUSTER = "remote"  # shared with other modules: tests/cluster/conftest.py


@pytest.fixture(scope="module")
def remote_nixl(cluster: TestCluster) -> TestCluster:
    return cluster


def decode_counter(cluster: TestCluster, key: str) -> float:
    return float(cluster.workers()["decode-0"].get(key, 0))


def settle(cluster: TestCluster) -> None:
    cluster.wait_clean()  # also lets the heartbeats carry the latest counters


def test_remote_prefill_over_nixl_equals_single_process(remote_nixl, reference_chat):
    settle(remote_nixl)
    before = decode_counter(remote_nixl, "kv_transfer_pages_total")
    for question in QUESTIONS[:3]:
        got = remote_nixl.ask(chat(question), MAX_TOKENS)
        assert got["choices"][0]["message"]["content"] == reference_chat(chat(question), MAX_TOKENS)
    settle(remote_nixl)
    workers = remote_nixl.workers()
    assert workers["decode-0"]["remote_prefills_total"] >= 3
    assert workers["decode-0"].get("local_prefills_total", 0) == 0
    assert decode_counter(remote_nixl, "kv_transfer_pages_total") > before
    assert workers["prefill-0"]["prefill_requests_total"] >= 3


def test_second_turn_reuses_the_first_and_moves_only_missing_pages(remote_nixl):
    cluster = remote_nixl
    messages = chat("Can I bring my dog?")
    turn1 = cluster.ask(messages, 20)
    settle(cluster)
    moved_before = decode_counter(cluster, "kv_transfer_pages_total")
    answer = turn1["choices"][0]["message"]["content"]
    messages += [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And my cat?"},
    ]
    turn2 = cluster.ask(messages, 8)
    settle(cluster)
    moved = decode_counter(cluster, "kv_transfer_pages_total") - moved_before
    p1, a1 = turn1["usage"]["prompt_tokens"], turn1["usage"]["completion_tokens"]
    p2, cached2 = (
        turn2["usage"]["prompt_tokens"],
        turn2["usage"]["prompt_tokens_details"]["cached_tokens"],
    )
    # decode kept turn 1 (prompt + answer, less the unwritten last token) in its cache
    decode_has = (p1 + a1 - 1) // PAGE
    # the prefill worker cached turn 1's prompt: it computes only the rest
    assert cached2 >= p1 // PAGE * PAGE
    # exactly the pages decode lacked crossed the wire
    assert moved == -(-p2 // PAGE) - decode_has


def test_official_openai_client_chat_and_completions(remote_nixl, reference_chat):
    client = openai.OpenAI(base_url=f"{remote_nixl.url}/v1", api_key="unused", max_retries=0)
    messages = chat(QUESTIONS[3])
    want = reference_chat(messages, MAX_TOKENS)
    full = client.chat.completions.create(
        model="default", messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    assert full.choices[0].message.content == want
    stream = client.chat.completions.create(
        model="default",
        messages=messages,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS
    completion = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=8, temperature=0
    )
    streamed = client.completions.create(
        model="default", prompt="The capital of France is", max_tokens=8, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed) == completion.choices[0].text
    assert completion.usage.completion_tokens == 8


def test_metrics_aggregate_every_worker(remote_nixl):
    """One remote-prefilled request moves each counter by exactly its own amounts."""
    settle(remote_nixl)
    before = remote_nixl.metrics()
    # a system prompt no worker has seen: nothing cached anywhere, every page moves
    answer = remote_nixl.ask(
        chat(QUESTIONS[4], f"[metrics {uuid.uuid4().hex}] {SYSTEM}"), MAX_TOKENS
    )
    settle(remote_nixl)
    text = remote_nixl.metrics()

    def moved(name: str, **labels: str) -> float:
        return metric_value(text, name, **labels) - metric_value(before, name, **labels)

    prompt = answer["usage"]["prompt_tokens"]
    cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == 0
    pages = -(-prompt // PAGE)  # the whole prompt, read from the prefill worker
    page_bytes = remote_nixl.workers()["decode-0"]["page_bytes"]
    assert moved("radixserve_ttft_seconds_count") == 1
    assert moved("radixserve_prefill_computed_tokens_total") == prompt - cached
    assert moved("radixserve_worker_kv_transfer_pages_total", worker="decode-0") == pages
    assert moved("radixserve_worker_kv_transfer_bytes_total", worker="decode-0") == (
        pages * page_bytes
    )
    assert moved("radixserve_kv_transfer_seconds_count", worker="decode-0") == 1
    for worker, role in (("decode-0", "decode"), ("prefill-0", "prefill")):
        assert metric_value(text, "radixserve_worker_up", worker=worker, role=role) == 1
        total = metric_value(text, "radixserve_worker_pages_total", worker=worker)
        used = metric_value(text, "radixserve_worker_pages_used", worker=worker)
        assert metric_value(text, "radixserve_worker_pages_free", worker=worker) == total - used


BAD_REQUESTS = [
    ("malformed JSON", b'{"model": "default", "messages": [', 400),
    (
        "invalid UTF-8",
        b'{"model": "default", "messages": [{"role": "user", "content": "\xff"}]}',
        400,
    ),
    ("wrong type", json.dumps({"model": "default", "messages": "hi"}).encode(), 400),
    (
        "negative max_tokens",
        json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}).encode(),
        400,
    ),
    (
        "prompt over the context",
        json.dumps({"messages": [{"role": "user", "content": "ok " * 9000}]}).encode(),
        400,
    ),
    (
        "unknown model",
        json.dumps({"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}).encode(),
        404,
    ),
    ("oversized body", b'{"messages": "' + b"x" * (9 << 20) + b'"}', 413),
]


@pytest.mark.parametrize(("case", "body", "status"), BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_bad_input_gets_an_openai_error_and_the_cluster_stays_up(remote_nixl, case, body, status):
    resp = remote_nixl.http.post(
        "/v1/chat/completions", content=body, headers={"content-type": "application/json"}
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status and error["message"] and error["type"]
    assert remote_nixl.http.get("/health").status_code == 200
    if case == "prompt over the context":  # this one went to the decode worker and back
        assert "context" in error["message"]
        remote_nixl.wait_clean()
