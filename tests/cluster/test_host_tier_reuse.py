"""Cross-worker reuse through the host tier, on the real cluster (the shared
``two-prefill-tiny`` cluster: two prefill workers that write each prefix through to the
host tier as they compute it): a system prompt computed on one prefill worker is in the
host tier; while that worker is busy, the decode worker sends the next request on it to
the other prefill worker (host hits make it cheap), which loads the prefix from the host
tier and computes only the question. Counters are read as deltas (test_prefill_routing
shares the cluster).

The cluster serves the tiny model (the `tiny_model` fixture): the subject is the host
tier and the routing, and the answer is compared with the same weights run in one
process. The tiny model computes the long prompt that keeps the first worker busy in
milliseconds, so that worker is stopped (SIGSTOP) instead: the prompt waits there,
unanswered, until the next request has been routed and served."""

from __future__ import annotations

import threading
import uuid

from tests.cluster.cluster_helpers import stopped
from tests.cluster.prompts import QUESTIONS, chat
from tests.cluster.test_host_tier import MAX_TOKENS, PAGE, branch_system, cached, host_hits

SHARED_CLUSTER = "two-prefill-tiny"  # shared with other modules: tests/cluster/conftest.py
PREFILLS = ("prefill-0", "prefill-1")


def test_a_prefix_computed_on_one_prefill_worker_is_reused_by_another(cluster, tiny_reference_chat):
    cluster.wait_host_tier()
    cluster.wait_clean()
    workers = cluster.workers()
    served = {w: workers[w].get("prefill_requests_total", 0) for w in PREFILLS}
    loaded = {w: workers[w].get("host_load_pages_total", 0) for w in PREFILLS}
    stored = workers["kvstore"].get("host_stored_pages_total", 0)
    tag = uuid.uuid4().hex[:8]  # prompts new to the cluster
    system = f"[{tag}] {branch_system(7)}"
    first = cluster.ask(chat(QUESTIONS[0], system), MAX_TOKENS)
    cluster.wait_clean()
    workers = cluster.workers()
    owner = max(PREFILLS, key=lambda w: workers[w].get("prefill_requests_total", 0) - served[w])
    other = "prefill-1" if owner == "prefill-0" else "prefill-0"
    served = {w: workers[w].get("prefill_requests_total", 0) for w in PREFILLS}
    system_pages = first["usage"]["prompt_tokens"] // PAGE - 2
    cluster.wait(
        lambda: (
            cluster.workers()["kvstore"].get("host_stored_pages_total", 0) - stored >= system_pages
        ),
        30,
        "the system prompt to be written through to the host tier",
    )

    # keep the owner busy with a long unrelated prompt (stopped, it holds it unanswered)...
    long_prompt = chat("Summarise the rules.", f"[{tag}] {branch_system(99) * 2}")
    busy = threading.Thread(target=cluster.ask, args=(long_prompt, 4))
    before = host_hits(cluster)
    try:
        with stopped(cluster, (owner,)):
            busy.start()
            cluster.wait(
                lambda: cluster.workers()["decode-0"]["awaiting_kv"] > 0 or not busy.is_alive(),
                30,
                "the long prompt to be sent to a prefill worker",
            )
            # (both idle, it went to the first by name, as the first request did)
            assert busy.is_alive(), "the long prompt was answered: not by the stopped owner"
            # ...then the shared prefix goes to the idle worker, which loads it from host
            second = cluster.ask(chat(QUESTIONS[1], system), MAX_TOKENS)
    finally:
        if busy.ident is not None:
            busy.join()
    workers = cluster.wait_clean()["workers"]  # counters of heartbeats sent after both
    assert {w: workers[w]["prefill_requests_total"] - served[w] for w in PREFILLS} == {
        owner: 1,  # the long prompt
        other: 1,  # the second question
    }
    cluster.wait(
        lambda: (
            cluster.workers()[other].get("host_load_pages_total", 0) - loaded[other] >= system_pages
        ),
        10,
        f"{other} to report loading the system prompt from the host tier",
    )
    assert cached(second) >= system_pages * PAGE
    assert host_hits(cluster) - before >= system_pages * PAGE
    text = second["choices"][0]["message"]["content"]
    assert text == tiny_reference_chat(chat(QUESTIONS[1], system), MAX_TOKENS)
    cluster.wait_clean()
