"""The cache audit as an operator of `radixserve serve` sees it: a corrupted cached page
shows in /metrics and /debug/cache, the failed-closed engine answers from no cache, and
POST /debug/cache/audit/clear puts the cache back in service. (The gateway has no API
keys here: its one tenant shares the cache the engine was primed with directly; the
clear's admin role is tested in tests/gateway/test_tenants.py.)"""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from radixserve.engine.async_engine import AsyncEngine
from radixserve.services.gateway import GatewaySettings, LocalEngineClient, create_app
from tests.engine.engine_helpers import make_engine
from tests.engine.test_cache_audit import OTHER, SYSTEM, corrupt_prefix_page, run
from tests.gateway.conftest import RunningServer

QUESTION = SYSTEM + " What is the longest river?"


@pytest.fixture
def audited() -> Iterator[httpx.Client]:
    """A gateway on an engine auditing every cache hit, failing closed, whose first
    cached page of SYSTEM has been overwritten with OTHER's."""
    engine = make_engine(
        "default", kv_cache_memory_gib=0.1, audit_sample_rate=1.0, audit_fail_closed=True
    )
    run(engine, SYSTEM)
    run(engine, OTHER)
    corrupt_prefix_page(engine, SYSTEM, OTHER)
    client = LocalEngineClient(AsyncEngine(engine))
    server = RunningServer(create_app(client, GatewaySettings()))
    try:
        with httpx.Client(base_url=server.url, timeout=60) as http:
            yield http
    finally:
        server.stop()
        client.close()


def complete(http: httpx.Client) -> tuple[str, int]:
    body = {"prompt": QUESTION, "max_tokens": 6, "temperature": 0}
    reply = http.post("/v1/completions", json=body).json()
    cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
    return reply["choices"][0]["text"], cached


def wait_for_audit(http: httpx.Client, checked: int) -> dict[str, int]:
    """/debug/cache once ``checked`` audits are done (the engine runs them when idle)."""
    deadline = time.monotonic() + 30
    while (stats := http.get("/debug/cache").json())["audit_checked"] < checked:
        assert time.monotonic() < deadline, stats
        time.sleep(0.05)
    return stats


def test_a_mismatch_fails_closed_until_the_operator_clears_it(audited: httpx.Client) -> None:
    _, cached = complete(audited)
    assert cached > 0
    stats = wait_for_audit(audited, 1)
    assert (stats["audit_mismatches"], stats["audit_fail_closed"]) == (1, 1)
    metrics = audited.get("/metrics").text
    assert 'radixserve_cache_audit_total{result="mismatch"} 1.0' in metrics
    assert "radixserve_cache_audit_fail_closed 1.0" in metrics

    recomputed, cached = complete(audited)
    assert cached == 0

    cleared = audited.post("/debug/cache/audit/clear")
    assert cleared.status_code == 200 and cleared.json() == {"workers": {"engine": True}}
    assert audited.get("/debug/cache").json()["audit_fail_closed"] == 0
    assert audited.post("/debug/cache/audit/clear").json() == {"workers": {"engine": False}}

    complete(audited)  # computed again, now cached
    text, cached = complete(audited)
    assert cached > 0 and text == recomputed
    stats = wait_for_audit(audited, 2)
    assert (stats["audit_mismatches"], stats["audit_fail_closed"]) == (1, 0)
