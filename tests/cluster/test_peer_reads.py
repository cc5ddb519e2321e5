"""Peer page reads on the real cluster: a conversation whose decode worker drains moves to
the other decode worker, which reads the conversation's prefix from the drained worker's
device cache (it lends its pages while it lingers) instead of recomputing it; an owner
killed while a read waits on it costs a recompute, with the right answer and nothing
left held.

Two decode workers compute their prompts themselves (``LOCAL_PREFILL_MAX_TOKENS`` above
the conversation), pages move over NIXL. The cluster serves the tiny model (the subject
is the machinery); answers are compared with the same weights run in one process."""

from __future__ import annotations

import os
import signal
import threading
import uuid

import pytest

from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import long_conversation
from tests.cluster.test_host_tier import cached

DECODES = ("decode-0", "decode-1")
MAX_TOKENS = 8
LINGER_S = 4.0


@pytest.fixture(scope="module")
def two_decodes(tiny_model):
    settings = {"LOCAL_PREFILL_MAX_TOKENS": "100000", "DRAIN_LINGER_S": str(LINGER_S),
                "PEER_READ_TIMEOUT_S": "5"}  # fmt: skip
    cluster = TestCluster(num_decode=2, model=tiny_model, decode=settings,
                          kv_cache_memory_gib=0.05)  # fmt: skip
    yield cluster
    cluster.stop()


def _owner(cluster: TestCluster, before: dict[str, int]) -> str:
    workers = cluster.workers()
    return max(DECODES, key=lambda w: workers[w].get("local_prefills_total", 0) - before[w])


def _counts(cluster: TestCluster, key: str) -> dict[str, int]:
    workers = cluster.workers()
    return {w: workers[w].get(key, 0) for w in DECODES}


def _drain(cluster: TestCluster, owner: str) -> tuple[int, int]:
    """SIGTERM ``owner`` (it drains, then lingers lending its pages; the supervisor starts
    it again once it left): its pid and generation."""
    pid = cluster.supervisor.pid(owner)
    assert pid is not None
    generation = cluster.workers()[owner]["generation"]
    os.kill(pid, signal.SIGTERM)
    cluster.wait(lambda: cluster.workers()[owner].get("draining"), 10, f"{owner} to drain")
    return pid, generation


def test_a_drained_workers_conversation_continues_elsewhere_from_its_pages(
    two_decodes, tiny_reference_chat
):
    cluster = two_decodes
    tag = uuid.uuid4().hex[:8]
    before = _counts(cluster, "local_prefills_total")
    for turns in (1, 2, 3):
        cluster.ask(long_conversation(tag, turns), MAX_TOKENS)
    owner = _owner(cluster, before)
    other = DECODES[1 - DECODES.index(owner)]
    read_before = _counts(cluster, "peer_read_pages_total")[other]
    connects_before = _counts(cluster, "peer_read_connects_total")[other]
    _, generation = _drain(cluster, owner)

    messages = long_conversation(tag, 4)
    answer = cluster.ask(messages, MAX_TOKENS)
    prompt = answer["usage"]["prompt_tokens"]
    assert cached(answer) >= 0.9 * prompt, answer["usage"]
    assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(messages, MAX_TOKENS)
    read = cluster.workers()[other]["peer_read_pages_total"] - read_before
    assert read * 16 >= 0.85 * prompt, (read, prompt)
    # the reader connected to the owner's pages when their link came up, not in the read
    assert cluster.workers()[other]["peer_connects_total"] >= 1
    assert cluster.workers()[other]["peer_read_connects_total"] == connects_before
    metrics = cluster.metrics()
    assert 'tier="peer"' in metrics
    # the drained worker leaves once it has lingered (and is started again); nothing is
    # held anywhere
    cluster.wait_restarted(owner, generation, LINGER_S + 60)
    cluster.wait_clean()


def test_an_owner_killed_while_a_read_waits_on_it_costs_a_recompute(
    two_decodes, tiny_reference_chat
):
    cluster = two_decodes
    cluster.wait(lambda: all(cluster.worker(w)["up"] for w in DECODES), 120,
                 "both decode workers up")  # fmt: skip
    tag = uuid.uuid4().hex[:8]
    before = _counts(cluster, "local_prefills_total")
    for turns in (1, 2):
        cluster.ask(long_conversation(tag, turns), MAX_TOKENS)
    owner = _owner(cluster, before)
    other = DECODES[1 - DECODES.index(owner)]
    asks = _counts(cluster, "peer_read_asks_total")[other]
    failed = _counts(cluster, "peer_read_refusals_total")[other]
    failed += _counts(cluster, "peer_read_failures_total")[other]
    pid, generation = _drain(cluster, owner)
    os.kill(pid, signal.SIGSTOP)  # it holds the pages and answers nothing
    messages = long_conversation(tag, 3)
    result: dict[str, dict] = {}
    turn = threading.Thread(target=lambda: result.update(a=cluster.ask(messages, MAX_TOKENS)))
    turn.start()
    try:
        # the stopped owner drops out of the gateway's list once silent: ask the reader's
        cluster.wait(lambda: cluster.workers()[other].get("peer_read_asks_total", 0) > asks, 30,
                     f"{other} to ask {owner} for the pages")  # fmt: skip
    finally:
        os.kill(pid, signal.SIGKILL)
        turn.join(60)
    answer = result["a"]
    assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(messages, MAX_TOKENS)
    workers = cluster.workers()
    ended = workers[other]["peer_read_refusals_total"] + workers[other]["peer_read_failures_total"]
    assert ended > failed
    assert cached(answer) < 0.5 * answer["usage"]["prompt_tokens"]  # computed, not read
    cluster.wait_restarted(owner, generation)
    cluster.wait_clean()
