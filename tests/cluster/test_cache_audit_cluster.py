"""The cache audit through `radixserve up`'s processes (the tiny model, pages over ZMQ):
each worker takes its own rate from its prefix (RADIXSERVE_PREFILL_AUDIT_SAMPLE_RATE,
RADIXSERVE_DECODE_AUDIT_SAMPLE_RATE), the prefill worker audits the cache hits it
computes, its counts reach the gateway's /metrics and /debug/cache through its
heartbeats, and POST /debug/cache/audit/clear reaches every worker and is answered.
(A corrupted page is flagged in tests/engine/test_cache_audit.py: a worker's pool cannot
be written from outside its process.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest

from tests.cluster.cluster_helpers import TestCluster
from tests.cluster.prompts import QUESTIONS, SYSTEM, chat


@pytest.fixture(scope="module")
def audited(tiny_model: str) -> Iterator[TestCluster]:
    cluster = TestCluster(
        transport="zmq",
        model=tiny_model,
        prefill={"AUDIT_SAMPLE_RATE": "1", "AUDIT_FAIL_CLOSED": "true"},
        decode={"AUDIT_SAMPLE_RATE": "1", "LOCAL_PREFILL_MAX_TOKENS": "0"},
    )
    try:
        yield cluster
    finally:
        cluster.stop()


def test_prefill_audits_reach_the_gateway_and_the_clear_reaches_every_worker(
    audited: TestCluster,
) -> None:
    system = f"[{uuid.uuid4().hex[:8]}] {SYSTEM}"
    audited.ask(chat(QUESTIONS[0], system), 4)
    second = audited.ask(chat(QUESTIONS[1], system), 4)  # prefilled remotely from its cache
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    deadline = time.monotonic() + 30
    while (prefill := audited.workers()["prefill-0"]).get("audit_checked", 0) < 1:
        assert time.monotonic() < deadline, prefill
        time.sleep(0.1)
    assert (prefill["audit_mismatches"], prefill["audit_fail_closed"]) == (0, 0)
    assert audited.workers()["decode-0"]["audit_checked"] == 0  # it computed no prompt
    metrics = audited.http.get("/metrics").text
    assert (
        'radixserve_cache_audit_total{result="match",role="prefill",worker="prefill-0"}' in metrics
    )
    cleared = audited.http.post("/debug/cache/audit/clear")
    assert cleared.status_code == 200
    assert cleared.json() == {"workers": {"decode-0": False, "prefill-0": False}}
