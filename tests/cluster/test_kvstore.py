"""The kvstore's cluster-wide index on the real cluster: workers' cache events reach it,
it survives being killed (serving goes on, the index rebuilds from resyncs, the workers
attach to its new, empty host tier), and a killed worker's entries leave it. The
cluster serves the tiny model: the subject is the index, not the answers."""

from __future__ import annotations

import os
import signal

from tests.cluster.cluster_helpers import TestCluster, index_query
from tests.cluster.prompts import QUESTIONS, chat

PAGE = 16


SHARED_CLUSTER = "default-tiny"  # shared with other modules: tests/cluster/conftest.py


def index_of(cluster: TestCluster, prompt_ids: list[int]) -> dict[str, int]:
    """Leading pages of ``prompt_ids`` each worker holds per the kvstore ({} if it is down)."""
    reply = index_query(cluster, prompt_ids, PAGE)
    return {} if reply is None else {name: int(n) for name, n in reply.device_pages.items()}


def test_index_follows_the_workers_caches_and_survives_a_kvstore_kill(cluster, reference_engine):
    messages = chat(QUESTIONS[0])
    prompt_ids = reference_engine.tokenizer.encode_chat(messages)
    full_pages = len(prompt_ids) // PAGE
    cluster.ask(messages, 8)  # 274 uncached tokens: prefilled remotely, then decoded
    cluster.wait(
        lambda: index_of(cluster, prompt_ids).get("decode-0", 0) == full_pages,
        10,
        "decode-0's pages in the index",
    )
    held = index_of(cluster, prompt_ids)
    assert held["prefill-0"] == full_pages  # the prefill worker cached the prompt too
    cluster.wait(  # the kvstore's stats reach the gateway with its next heartbeat
        lambda: cluster.workers()["kvstore"]["index_pages"] >= full_pages,
        5,
        "the kvstore's heartbeat to count the pages",
    )

    # kill the kvstore: serving goes on without it
    os.kill(cluster.supervisor.pid("kvstore"), signal.SIGKILL)
    cluster.ask(chat(QUESTIONS[1]), 8)
    # restarted, it learns everything again from both workers' resyncs (each arrives on
    # its own: waiting for one and reading the other raced)
    cluster.wait(
        lambda: (
            cluster.workers()["kvstore"]["up"]
            and index_of(cluster, prompt_ids) == {"decode-0": full_pages, "prefill-0": full_pages}
        ),
        60,
        "the index to rebuild from both workers after the kvstore restarted",
    )
    assert cluster.supervisor.restarts["kvstore"] >= 1

    # its host tier came back empty, and both workers attached to it again (each side's
    # heartbeat arrives on its own: the kvstore reports its tier from the first attach on)
    def attached() -> bool:
        w = cluster.workers()
        return "host_pages_stored" in w["kvstore"] and all(
            w[name].get("host_attached") for name in ("prefill-0", "decode-0")
        )

    cluster.wait(attached, 30, "the workers to attach to the restarted host tier")
    assert cluster.workers()["kvstore"]["host_pages_stored"] == 0
    cluster.ask(chat(QUESTIONS[3]), 8)
    cluster.wait_clean()


def test_a_killed_workers_entries_leave_the_index(cluster, reference_engine):
    messages = chat(QUESTIONS[2])
    prompt_ids = reference_engine.tokenizer.encode_chat(messages)
    cluster.ask(messages, 8)
    cluster.wait(lambda: "decode-0" in index_of(cluster, prompt_ids), 10, "decode-0 indexed")
    old_generation = cluster.workers()["decode-0"]["generation"]
    os.kill(cluster.supervisor.pid("decode-0"), signal.SIGKILL)
    # gone from the index once the kvstore notices (heartbeat timeout), and a restarted
    # decode-0 starts with an empty cache, so it never reappears for this prompt
    cluster.wait(lambda: "decode-0" not in index_of(cluster, prompt_ids), 30, "decode-0 dropped")
    cluster.wait_restarted("decode-0", old_generation)
    assert "decode-0" not in index_of(cluster, prompt_ids)
    assert "prefill-0" in index_of(cluster, prompt_ids)
    cluster.ask(messages, 8)
    cluster.wait(lambda: "decode-0" in index_of(cluster, prompt_ids), 10, "decode-0 again")
    cluster.wait_clean()
