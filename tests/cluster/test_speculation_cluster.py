"""Speculative decoding through the cluster. The decode worker drafts from its own draft
index: a question asked again is drafted from the first answer, which is in no prompt;
both answers are the single process's, and the worker's counters show the drafts
verified and kept. (The shared ``default-tiny`` cluster runs its workers with
``RADIXSERVE_SPECULATIVE_METHOD=both``, so every module sharing it compares answers with
one engine without speculation; this module has a cluster of its own, drafting from the
index alone: what the modules before it drafted there would weigh each draft token, and
with the tiny model a row is dear against a step, so a record of misses there could keep
the repeat from being drafted at all.)"""

from __future__ import annotations

import uuid

import pytest

from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat

MAX_TOKENS = 40


@pytest.fixture(scope="module")
def cluster(tiny_model):
    cluster = TestCluster(transport="zmq", model=tiny_model,
                          env={"RADIXSERVE_SPECULATIVE_METHOD": "radix"})  # fmt: skip
    yield cluster
    cluster.stop()


def _radix_counters(cluster: TestCluster) -> tuple[float, float]:
    cluster.wait_clean()  # also lets the heartbeats carry the latest counters
    decode = cluster.workers()["decode-0"]
    return (float(decode.get("speculative_radix_drafted_total", 0)),
            float(decode.get("speculative_radix_accepted_total", 0)))  # fmt: skip


def test_a_repeated_question_is_drafted_from_the_first_answer(cluster, tiny_reference_chat):
    messages = chat(QUESTIONS[2], f"[{uuid.uuid4().hex[:8]}] {SYSTEM}")
    want = tiny_reference_chat(messages, MAX_TOKENS)
    first = cluster.ask(messages, MAX_TOKENS)
    drafted, accepted = _radix_counters(cluster)
    second = cluster.ask(messages, MAX_TOKENS)
    drafted_after, accepted_after = _radix_counters(cluster)
    assert first["choices"][0]["message"]["content"] == want
    assert second["choices"][0]["message"]["content"] == want
    assert drafted_after > drafted and accepted_after > accepted, (drafted, drafted_after)
