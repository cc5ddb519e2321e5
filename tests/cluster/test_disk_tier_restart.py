"""The kvstore's disk tier across a kvstore crash, on the real cluster (processes, ZMQ,
HTTP, the supervisor that restarts what dies).

A decode worker computing every prompt itself, whose device pool holds two of the
conversations (the tiny model: `tests.cluster.test_host_tier`), over a host tier holding
one and a disk tier in the test's tmp directory, whose hits are read in chunks of a page
overlapped with the worker's reads (``disk_read_chunk_mib`` 0: the tiny model's pages
are 8 KiB, a whole prefix would be one chunk, read before the lease). While conversations
are being asked, the kvstore process is SIGKILLed as soon as it is seen writing to disk
what they make its host tier evict: no flush, writes cut wherever they were. The
supervisor starts it again on the same directory, and it rebuilds its disk index from
the files:

* every request answered meanwhile is the single-process engine's answer (the worker
  computes what the kvstore cannot serve);
* every page the restarted kvstore lists is one its rebuild read back with a valid
  checksum (torn records are counted and left out), and serving the conversations it
  lists reads them all back valid (no corrupt page counted after the rebuild);
* a conversation the index lists on the tiers (the leading pages of its prefix the
  host tier evicted before the kill; its host memory is gone) and on no device is
  served from disk: its usage reports those pages cached, the gateway's
  ``radixserve_cached_tokens_total{tier="disk"}`` grows by as much, and the answer is
  the single-process engine's.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from tests.cluster.cluster_helpers import TestCluster, index_query, metric_value
from tests.cluster.prompts import QUESTIONS, chat
from tests.cluster.test_host_tier import (
    MAX_TOKENS,
    PAGE,
    branch_system,
    cached,
    gib,
    tiers_env,
)
from tests.engine.engine_helpers import tiny_checkpoint

DEVICE_PAGES = 36  # two conversations of 17 full pages
HOST_PAGES = 20  # one conversation: what the device evicts goes on to disk
CONVERSATIONS = 8


def kvstore_stats(cluster: TestCluster) -> dict:
    return cluster.workers().get("kvstore", {"up": False})


def settled_writes(cluster: TestCluster) -> Callable[[], bool]:
    """A condition: the kvstore has written to disk, queues no write, and neither its
    spills nor its writes moved since the last heartbeat seen."""
    seen: list[tuple] = []

    def settled() -> bool:
        stats = kvstore_stats(cluster)
        key = (stats.get("heartbeats_total"), stats.get("host_stored_pages_total"),
               stats.get("disk_write_pages_total", 0))  # fmt: skip
        if seen and key[0] == seen[-1][0]:
            return False  # no new heartbeat yet
        moved = not seen or key[1:] != seen[-1][1:]
        seen.append(key)
        return key[2] > 0 and not stats.get("disk_write_queued_pages") and not moved

    return settled


def tier_counters(cluster: TestCluster) -> dict:
    """The workers' tier counters (lookups, timeouts, failed loads, refused reads): what
    a request that read nothing from the tiers left behind."""
    return {
        name: {k: v for k, v in stats.items() if k.startswith(("host_", "disk_", "kv_"))}
        for name, stats in cluster.workers().items() if isinstance(stats, dict)
    }  # fmt: skip


def test_a_kvstore_killed_mid_write_restarts_on_its_files_and_serves_them_exactly(
    tiny_model, tiny_reference_chat, tmp_path
):
    cluster = TestCluster(
        transport="zmq",
        num_prefill=0,
        model=tiny_model,
        kv_cache_memory_gib=gib(DEVICE_PAGES),
        # disk hits read in page-sized chunks, overlapped with the worker's reads
        kvstore={**tiers_env(HOST_PAGES, tmp_path, 16 * HOST_PAGES), "DISK_READ_CHUNK_MIB": "0"},
        # a busy machine must not turn the tiers' lookups into timeouts
        decode={"HOST_LOOKUP_TIMEOUT_S": "5", "HOST_LOAD_MIN_TOKENS": "0"},
    )
    conversations = [
        chat(QUESTIONS[i % len(QUESTIONS)], branch_system(i)) for i in range(CONVERSATIONS)
    ]
    try:
        cluster.wait_host_tier()
        # a first pass: the early conversations go device -> host -> disk (a prefix is
        # whole on disk only once the host tier has evicted its head too)
        for messages in conversations[:6]:
            cluster.ask(messages, MAX_TOKENS)
        # ... all of it: a loaded machine may still be spilling and writing the first
        # pass when the second begins, which would leave the kill little on disk
        cluster.wait(settled_writes(cluster), 30, "the kvstore to write the first pass to disk")
        # the rest, asked while the kvstore is killed as soon as it is seen writing what
        # they evict (its stats come with its heartbeats, every 0.2 s)
        written = kvstore_stats(cluster)["disk_write_pages_total"]
        with ThreadPoolExecutor(2) as pool:
            answers = pool.map(
                lambda messages: cluster.ask(messages, MAX_TOKENS),
                conversations[6:] + conversations[:2],
            )
            cluster.wait(lambda: kvstore_stats(cluster).get("disk_write_pages_total", 0) > written,
                         60, "the kvstore to write this pass's evictions")  # fmt: skip
            old = cluster.workers()["kvstore"]["generation"]
            os.kill(cluster.supervisor.pid("kvstore"), signal.SIGKILL)
            cluster.wait_restarted("kvstore", old)  # supervises: the restart happens here
            during = list(answers)
        for messages, answer in zip(conversations[6:] + conversations[:2], during):
            text = answer["choices"][0]["message"]["content"]
            assert text == tiny_reference_chat(messages, MAX_TOKENS)
        cluster.wait_host_tier()
        # its counters come with its first heartbeat, before its rebuild is done: the
        # tier says when it is (a loaded machine reads the files slowly)
        cluster.wait(lambda: kvstore_stats(cluster).get("disk_tier_ready") == 1, 20,
                     "the restarted kvstore's rebuild")  # fmt: skip
        rebuilt = kvstore_stats(cluster)
        assert rebuilt["disk_tier_up"] == 1 and rebuilt["disk_restored_pages"] > 0
        torn = rebuilt["disk_corrupt_pages_total"]  # records cut by the kill, not listed

        tokenizer = tiny_checkpoint().tokenizer
        served = []  # pages served from disk, per conversation
        for messages in conversations:
            ids = tokenizer.encode_chat(messages)
            full_pages = (len(ids) - 1) // PAGE
            reply = index_query(cluster, ids[: full_pages * PAGE])
            if reply is None or not reply.host_pages or reply.device_pages:
                continue  # none of it on disk, or some of it on the device
            listed = reply.host_pages  # the host tier holds none of it: only asked once
            before = metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk")
            answer = cluster.ask(messages, MAX_TOKENS)
            after = metric_value(cluster.metrics(), "radixserve_cached_tokens_total", tier="disk")
            # what the index listed, the rest computed
            assert cached(answer) == listed * PAGE, json.dumps(tier_counters(cluster))
            assert after - before == listed * PAGE  # all of it read back from disk
            text = answer["choices"][0]["message"]["content"]
            assert text == tiny_reference_chat(messages, MAX_TOKENS)
            served.append(listed)
        assert len(served) >= 2 and max(served) >= 16, f"served from disk: {served}; {rebuilt}"
        # its stats as of a heartbeat sent after the last answer
        cluster.wait(lambda: kvstore_stats(cluster).get("disk_hit_pages_total") == sum(served),
                     5, f"the kvstore to count {sum(served)} pages read from disk")  # fmt: skip
        store = kvstore_stats(cluster)
        assert store["disk_corrupt_pages_total"] == torn  # every listed page read back valid
        assert store["disk_overlapped_promotions_total"] > 0  # the worker read meanwhile
        cluster.wait_clean()
    finally:
        cluster.stop()
