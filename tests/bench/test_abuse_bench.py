"""`radixserve bench --scenario abuse --quick` end to end on a real local cluster.

The latency ratios are the benchmark's to report (bench/README.md), not this test's to
assert; the test checks the JSON's shape, that each abuse met the bound meant for it
(the 256-prompt completion and the 3 MiB schema refused by name, the slow body answered
408, the flood's retries refused with 429s naming its limit), that every chat turn
succeeded, and that afterwards the cluster holds nothing: no request in flight or
admitted at the gateway, no live request, locked page, lease or task on any worker. It
runs the tiny random model (``--model``): the bounds are the subject, not the text.

Marked ``benchmark`` (half a minute of floods, where `make test` has a bound): the
bounds themselves are tested one by one in tests/gateway (test_admission,
test_http_server, test_prepare_limits, test_deadline); ``make bench-test`` runs this.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


@pytest.mark.benchmark
def test_abuse_bench_quick(tmp_path: Path, capsys, tiny_model: str) -> None:
    out = tmp_path / "abuse.json"
    code = main(["bench", "--scenario", "abuse", "--quick", "--model", tiny_model,
                 "--out", str(out)])  # fmt: skip
    result = json.loads(out.read_text())
    assert result["scenario"] == "abuse" and result["preset"] == "quick"
    chat = result["chat"]
    for phase in ("alone", "under_flood"):
        summary = chat[phase]
        assert summary["succeeded"] == summary["turns"] == 3, chat
        assert summary["cached_ttft_p90_ms"] > 0 and summary["itl_p50_ms"] > 0
        assert all(n > 0 for n in summary["cached_tokens"][1:]), summary  # turns 2..N cached
    flood = result["flood"]
    assert flood["big_batch"]["status"] == 400
    assert "tenant flood's share" in flood["big_batch"]["message"]
    assert flood["big_schema"]["status"] == 400 and flood["big_schema"]["schema_bytes"] > 3e6
    assert "max_schema_bytes" in flood["big_schema"]["message"]
    assert flood["slow_body"]["status"] == 408
    assert flood["slow_head"]["closed"]
    assert flood["retry_loop"]["statuses"].get("429", 0) > 0
    # each unread stream decodes 8 choices: the first is admitted, the rest only while
    # the tenant's share of sequences holds them
    statuses = flood["unread_streams"]["statuses"]
    assert statuses[0] == 200 and set(statuses) <= {200, 429}, statuses
    assert result["gateway_counters"]["refused"].get("tenant_share", 0) > 0
    assert result["gateway_counters"]["cut"].get("body_timeout", 0) >= 1
    assert result["after"]["held"] == {}, result["after"]
    assert result["after"]["admission"]["requests"] == 0
    targets = result["targets"]
    for key in ("chat_all_succeeded", "flood_429s_name_its_limit", "nothing_held_after"):
        assert targets[key], targets
    assert code == (0 if all(targets.values()) else 1)
    assert "abuse benchmark (quick)" in capsys.readouterr().out
