"""Tensor-parallel workers in a real cluster: a prefill worker of TP=1 and a decode worker
of TP=2 (two processes, its KV heads split between them), pages over NIXL, on the tiny
model (4 query and 2 KV heads: one KV head per decode rank), float32 (the ranks'
all-reduce adds in another order than one process: tests/cluster/conftest.py).

- Every prompt prefills remotely (``local_prefill_max_tokens`` 0): each decode rank reads
  its KV head of the prefill worker's whole pages, and the answers equal the
  single-process engine's.
- The decode worker writes each prefix through to the kvstore's host tier (``uses`` 1):
  both of its ranks copy their head of every page into one shared spill buffer, so the
  host tier holds whole pages. The prefill worker is then killed and restarted (an empty
  device cache), and a prompt sharing that prefix is prefilled there after loading the
  prefix from the host tier: a TP=1 worker reading pages a TP=2 worker spilled, its
  host-tier hit counted and its answer equal to the single process's.
- Last, a TP=1 decode worker joins and the TP=2 one is retired (it drains): a prefix the
  TP=2 worker spilled is loaded from the host tier by the TP=1 decode worker, which
  computes the rest itself, its answer equal to the single process's.

The other pairs (2 -> 1, 2 -> 2, over NIXL and ZMQ), the refused 2 -> 3 pair and the
kill of a rank run in make bench-test (tests/cluster/test_tp_matrix.py)."""

from __future__ import annotations

import dataclasses
import os
import signal
import uuid
from collections.abc import Iterator

import pytest

from radixserve.bench.chaos_faults import rank_pids
from radixserve.launch.cluster import worker_spec
from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tp_cluster(tiny_model: str) -> Iterator[TestCluster]:
    cluster = TestCluster(
        transport="nixl", model=tiny_model, decode_tp=2, float32=True,
        decode={"LOCAL_PREFILL_MAX_TOKENS": "0", "HOST_WRITE_THROUGH_USES": "1"},
    )  # fmt: skip
    yield cluster
    cluster.stop()


def counter(cluster: TestCluster, worker: str, key: str) -> float:
    return float(cluster.workers()[worker].get(key, 0))


def test_prefill_tp1_to_decode_tp2_over_nixl_equals_single_process(
    tp_cluster: TestCluster, tiny_float32_reference_chat
) -> None:
    assert len(rank_pids(tp_cluster.supervisor.pid("decode-0"))) == 1  # rank 1; rank 0 is it
    before = counter(tp_cluster, "decode-0", "kv_transfer_pages_total")
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM}"
    for question in QUESTIONS[:2]:
        answer = tp_cluster.ask(chat(question, system), MAX_TOKENS)
        want = tiny_float32_reference_chat(chat(question, system), MAX_TOKENS)
        assert answer["choices"][0]["message"]["content"] == want
    tp_cluster.wait_clean()
    assert counter(tp_cluster, "decode-0", "kv_transfer_pages_total") > before
    assert counter(tp_cluster, "decode-0", "remote_prefills_total") >= 2


def test_a_prefix_spilled_by_tp2_decode_is_loaded_by_tp1_prefill(
    tp_cluster: TestCluster, tiny_float32_reference_chat
) -> None:
    spill_then_load(tp_cluster, tiny_float32_reference_chat)


def spill_then_load(cluster: TestCluster, reference) -> None:
    """A prefix the decode worker writes through to the host tier is loaded from there by
    the prefill worker, restarted meanwhile (an empty device cache); both answers equal
    the single process's."""
    cluster.wait_host_tier()
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM * 3}"  # well past host_load_min_tokens
    first = cluster.ask(chat(QUESTIONS[0], system), MAX_TOKENS)
    assert first["choices"][0]["message"]["content"] == reference(
        chat(QUESTIONS[0], system), MAX_TOKENS
    )
    # the decode worker (each of its ranks, its heads) wrote the prefix through
    cluster.wait(lambda: counter(cluster, "decode-0", "host_spill_stored_pages_total") > 0,
                 30, "decode-0's pages stored in the host tier")  # fmt: skip
    old = cluster.worker("prefill-0")["generation"]
    os.kill(cluster.supervisor.pid("prefill-0"), signal.SIGKILL)
    cluster.wait_restarted("prefill-0", old)
    cluster.wait_host_tier()
    second = cluster.ask(chat(QUESTIONS[1], system), MAX_TOKENS)
    assert second["choices"][0]["message"]["content"] == reference(
        chat(QUESTIONS[1], system), MAX_TOKENS
    )
    cluster.wait_clean()
    prefill = cluster.worker("prefill-0")
    host = {key: value for key, value in prefill.items() if key.startswith("host_")}
    assert prefill.get("host_loads_total", 0) >= 1, host
    assert prefill.get("host_load_pages_total", 0) * 16 >= 256, host


def test_a_prefix_spilled_by_tp2_decode_is_loaded_by_tp1_decode(
    tp_cluster: TestCluster, tiny_float32_reference_chat
) -> None:
    """The module's last test: it replaces the TP=2 decode worker with a TP=1 one."""
    tp_cluster.wait_host_tier()
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM * 3}"
    stored = counter(tp_cluster, "decode-0", "host_spill_stored_pages_total")
    first = tp_cluster.ask(chat(QUESTIONS[0], system), MAX_TOKENS)
    assert first["choices"][0]["message"]["content"] == tiny_float32_reference_chat(
        chat(QUESTIONS[0], system), MAX_TOKENS
    )
    tp_cluster.wait(
        lambda: counter(tp_cluster, "decode-0", "host_spill_stored_pages_total") >= stored + 16,
        30, "decode-0's pages of the new prefix stored in the host tier",
    )  # fmt: skip
    # a TP=1 decode worker that computes what the host tier does not hold itself
    config = dataclasses.replace(
        tp_cluster.config, decode_tp=1,
        decode_env={**tp_cluster.config.decode_env, "RADIXSERVE_DECODE_LOCAL_PREFILL_MAX_TOKENS": "256"},
    )  # fmt: skip
    spec, _ = worker_spec(config, "decode", 1, tp_cluster.processes.kvstore, [])
    assert "RADIXSERVE_DECODE_TP" not in spec.env
    # both at once: the decode pool's size (1) stays what the cluster's pools keep
    tp_cluster.supervisor.add(spec)
    tp_cluster.supervisor.retire("decode-0", timeout_s=30)
    tp_cluster.wait(lambda: tp_cluster.worker("decode-1").get("host_attached", False), 120,
                    "the TP=1 decode worker up and attached to the host tier")  # fmt: skip
    tp_cluster.wait(lambda: not tp_cluster.worker("decode-0")["up"], 60, "decode-0 retired")
    second = tp_cluster.ask(chat(QUESTIONS[1], system), MAX_TOKENS)
    assert second["choices"][0]["message"]["content"] == tiny_float32_reference_chat(
        chat(QUESTIONS[1], system), MAX_TOKENS
    )
    tp_cluster.wait_clean()
    decode = tp_cluster.worker("decode-1")
    assert decode.get("host_loads_total", 0) == 1, decode
    assert decode.get("host_load_pages_total", 0) * 16 >= 256, decode
    assert decode.get("remote_prefills_total", 0) == 0, decode
