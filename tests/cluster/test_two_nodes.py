"""A cluster of two "nodes" on one machine (`radixserve up --nodes 2`): a kvstore per node,
each holding its node's host tier, a shard of the cache index (page hash mod 2) and the
whole membership; decode-0 on node 0, decode-1 on node 1. The nodes are processes here
(the Docker test runs them as containers on their own networks).

Shown: every kvstore lists every member and indexes its shard of every worker's pages
(the shards' answers merge into each worker's leading run); a worker's write-through
lands in its own node's host tier only; a conversation whose worker drains continues on
the other node's worker from the drained one's pages; and a kvstore SIGKILLed mid-traffic
loses no request and no member, routing keeps asking the surviving shard, and the
restarted kvstore is whole again (index and membership) from the workers' resyncs.

Two decode workers compute their prompts themselves (``LOCAL_PREFILL_MAX_TOKENS`` above
the conversation), pages move over NIXL. The tiny model serves (the subject is the
machinery); answers are compared with the same weights run in one process."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid

import pytest

from tests.cluster.cluster_helpers import TestCluster, index_query
from tests.cluster.prompts import long_conversation
from tests.cluster.test_host_tier import cached

DECODES = ("decode-0", "decode-1")
KVSTORES = ("kvstore-0", "kvstore-1")
PAGE = 16
MAX_TOKENS = 8
LINGER_S = 4.0


@pytest.fixture(scope="module")
def two_nodes(tiny_model):
    settings = {"LOCAL_PREFILL_MAX_TOKENS": "100000", "DRAIN_LINGER_S": str(LINGER_S),
                "PEER_READ_TIMEOUT_S": "5", "HOST_WRITE_THROUGH_USES": "1"}  # fmt: skip
    cluster = TestCluster(nodes=2, num_prefill=0, num_decode=2, model=tiny_model,
                          decode=settings, kv_cache_memory_gib=0.05)  # fmt: skip
    yield cluster
    cluster.stop()


def _stat(cluster: TestCluster, name: str, key: str) -> int:
    return int(cluster.worker(name).get(key) or 0)


def _owner(cluster: TestCluster, before: dict[str, int]) -> str:
    return max(DECODES, key=lambda w: _stat(cluster, w, "local_prefills_total") - before[w])


def _merged_index(cluster: TestCluster, prompt_ids: list[int]) -> dict[str, int]:
    """Each worker's leading pages of ``prompt_ids`` from both shards' answers."""
    merged: dict[str, int] = {}
    for shard, kvstore in enumerate(KVSTORES):
        reply = index_query(cluster, prompt_ids, PAGE, kvstore=kvstore, shard=(shard, 2))
        assert reply is not None, f"{kvstore} did not answer"
        for worker, pages in reply.device_pages.items():
            merged[worker] = max(merged.get(worker, 0), int(pages))
    return merged


def test_every_kvstore_keeps_the_members_its_shard_and_its_nodes_host_tier(
    two_nodes, tiny_reference_engine
):
    cluster = two_nodes
    cluster.wait(lambda: all(_stat(cluster, k, "members") == 2 for k in KVSTORES), 30,
                 "both kvstores to list both workers")  # fmt: skip
    stored = {k: _stat(cluster, k, "host_stored_pages_total") for k in KVSTORES}
    before = {w: _stat(cluster, w, "local_prefills_total") for w in DECODES}
    messages = long_conversation(uuid.uuid4().hex[:8], 1)
    cluster.ask(messages, MAX_TOKENS)
    owner = _owner(cluster, before)
    node, other_node = (0, 1) if owner == "decode-0" else (1, 0)
    ids = tiny_reference_engine.tokenizer.encode_chat(messages)
    full = len(ids) // PAGE
    cluster.wait(lambda: _merged_index(cluster, ids[: full * PAGE]).get(owner) == full, 10,
                 f"both shards to index {owner}'s pages")  # fmt: skip
    # each shard holds its own part of them, not all
    pages = {k: _stat(cluster, k, "index_pages") for k in KVSTORES}
    assert all(pages.values()), pages
    # written through to its own node's host tier only
    cluster.wait(lambda: _stat(cluster, KVSTORES[node], "host_stored_pages_total") > stored[
        KVSTORES[node]], 10, f"{owner}'s pages in its node's host tier")  # fmt: skip
    assert _stat(cluster, KVSTORES[other_node], "host_stored_pages_total") == stored[
        KVSTORES[other_node]]  # fmt: skip


def test_a_drained_workers_conversation_continues_on_the_other_node_from_its_pages(
    two_nodes, tiny_reference_chat
):
    cluster = two_nodes
    cluster.wait(lambda: all(cluster.worker(w)["up"] for w in DECODES), 120, "both decodes up")
    tag = uuid.uuid4().hex[:8]
    before = {w: _stat(cluster, w, "local_prefills_total") for w in DECODES}
    for turns in (1, 2, 3):
        cluster.ask(long_conversation(tag, turns), MAX_TOKENS)
    owner = _owner(cluster, before)
    other = DECODES[1 - DECODES.index(owner)]
    read_before = _stat(cluster, other, "peer_read_pages_total")
    pid = cluster.supervisor.pid(owner)
    assert pid is not None
    generation = cluster.worker(owner)["generation"]
    os.kill(pid, signal.SIGTERM)
    cluster.wait(lambda: cluster.worker(owner).get("draining"), 10, f"{owner} to drain")

    messages = long_conversation(tag, 4)
    answer = cluster.ask(messages, MAX_TOKENS)
    prompt = answer["usage"]["prompt_tokens"]
    assert cached(answer) >= 0.9 * prompt, answer["usage"]
    assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(messages, MAX_TOKENS)
    read = _stat(cluster, other, "peer_read_pages_total") - read_before
    assert read * PAGE >= 0.85 * prompt, (read, prompt)
    cluster.wait_restarted(owner, generation, LINGER_S + 60)
    cluster.wait_clean()


def test_a_prefix_in_another_nodes_host_tier_is_read_from_there(two_nodes, tiny_reference_chat):
    """Its owner stalled (SIGSTOP: its device pages out of reach), a conversation's next
    request goes to the other node's worker, which finds the prefix in the owner's node's
    host tier (written through) and reads it from there instead of computing it."""
    cluster = two_nodes
    cluster.wait(lambda: all(cluster.worker(w)["up"] for w in DECODES), 120, "both decodes up")
    before = {w: _stat(cluster, w, "local_prefills_total") for w in DECODES}
    stored = {k: _stat(cluster, k, "host_stored_pages_total") for k in KVSTORES}
    messages = long_conversation(uuid.uuid4().hex[:8], 1)
    first = cluster.ask(messages, MAX_TOKENS)
    owner = _owner(cluster, before)
    reader = DECODES[1 - DECODES.index(owner)]
    home, remote = KVSTORES[DECODES.index(reader)], KVSTORES[DECODES.index(owner)]
    full = first["usage"]["prompt_tokens"] // PAGE - 1
    cluster.wait(lambda: _stat(cluster, remote, "host_stored_pages_total") - stored[remote]
                 >= full, 15, f"{owner}'s prompt written through to {remote}")  # fmt: skip
    hits = {k: _stat(cluster, k, "host_hit_pages_total") for k in KVSTORES}
    loads = _stat(cluster, reader, "host_remote_loads_total")
    pid = cluster.supervisor.pid(owner)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    try:
        cluster.wait(lambda: not cluster.worker(owner)["up"], 30, f"{owner} out of reach")
        answer = cluster.ask(messages, MAX_TOKENS)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert cached(answer) >= 0.9 * answer["usage"]["prompt_tokens"], answer["usage"]
    assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(messages, MAX_TOKENS)
    assert _stat(cluster, reader, "host_remote_loads_total") == loads + 1
    assert _stat(cluster, remote, "host_hit_pages_total") - hits[remote] >= full
    assert _stat(cluster, home, "host_hit_pages_total") == hits[home]
    cluster.wait(lambda: cluster.worker(owner)["up"], 60, f"{owner} back")
    cluster.wait_clean()


def test_a_kvstore_killed_mid_traffic_loses_no_request_and_comes_back_whole(
    two_nodes, tiny_reference_chat
):
    cluster = two_nodes
    cluster.wait(lambda: all(cluster.worker(w)["up"] for w in DECODES), 120, "both decodes up")
    victim = KVSTORES[1]
    generation = cluster.worker(victim)["generation"]
    partial = {w: _stat(cluster, w, "index_partial_answers_total") for w in DECODES}
    answers: list[tuple[list[dict[str, str]], dict]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def traffic() -> None:  # new conversations (each asks the index: its prompt is missing)
        try:  # from before the kill until the kvstore is back, four at least
            while not done.is_set() or len(answers) < 4:
                messages = long_conversation(uuid.uuid4().hex[:8], 1)
                answers.append((messages, cluster.ask(messages, MAX_TOKENS)))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    thread = threading.Thread(target=traffic)
    thread.start()
    try:
        cluster.wait(lambda: bool(answers), 60, "the first answer before the kill")
        pid = cluster.supervisor.pid(victim)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        # while it is gone, both workers stay listed and up at the gateway (kvstore-0 keeps
        # the membership)
        cluster.wait(lambda: not cluster.worker(victim)["up"], 30, f"{victim} down")
        assert all(cluster.worker(w)["up"] for w in DECODES)

        # the supervisor restarts it; the workers' resyncs fill its shard and its registry
        def whole() -> bool:
            view = cluster.worker(victim)
            return (
                bool(view["up"])
                and view.get("generation") != generation
                and view.get("members") == 2
                and view.get("index_workers") == 2
                and bool(view.get("index_pages"))
            )

        cluster.wait(whole, 60, f"{victim} back with its shard and the members")
        print(f"{victim} whole again {time.monotonic() - killed:.1f} s after SIGKILL "
              "(restart backoff 0.2 s, model-free start)")  # fmt: skip
    finally:
        done.set()
        thread.join(120)
    assert not errors, errors
    assert len(answers) >= 4
    for messages, answer in answers:
        assert answer["choices"][0]["message"]["content"] == tiny_reference_chat(
            messages, MAX_TOKENS
        )
    # a lookup while it was gone was answered by the surviving shard alone (the counter
    # reaches the gateway with a heartbeat)
    cluster.wait(lambda: any(_stat(cluster, w, "index_partial_answers_total") > partial[w]
                             for w in DECODES), 10, "a lookup answered by one shard")  # fmt: skip
    messages = long_conversation(uuid.uuid4().hex[:8], 1)
    assert cluster.ask(messages, MAX_TOKENS)["choices"][0]["message"]["content"] == (
        tiny_reference_chat(messages, MAX_TOKENS)
    )
    cluster.wait_clean()
