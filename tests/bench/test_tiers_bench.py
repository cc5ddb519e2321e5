"""`radixserve bench --scenario tiers --quick` end to end on a real local cluster.

The speed ratios are the benchmark's to report (bench/README.md), not this test's to
assert; the test checks that the run is what it claims: the pool outgrew host memory,
so the oldest prefixes came back from the disk tier (every one of their full pages
cached), each revisit is classified by one source that served some of it, and the two
rates the admission compares were measured; after kvstore restarts with the disk read
overlapped and not, prefixes came back from disk both ways. It runs the tiny random
model (``--model``): the tiers are the subject, and the pool is sized by its pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.cli import main


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_tiers_bench_quick(tmp_path: Path, capsys, tiny_model: str) -> None:
    out = tmp_path / "tiers.json"
    argv = ["bench", "--scenario", "tiers", "--quick", "--model", tiny_model]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["scenario"] == "tiers" and result["preset"] == "quick"
    rows = result["rows"]
    assert len(rows) == 24  # 2 passes over 4 rounds of 128, 256, 512 tokens (no warm-up)
    assert {r["tier"] for r in rows} <= {"disk", "host", "device", "recompute"}
    # oldest first, the prefixes revisited early lie on disk only: each comes back whole
    # (its full pages, short of the last token); in the drawn order, some come from the
    # device or host memory, or partly from disk
    oldest_first = [r for r in rows[:12] if r["tier"] == "disk"]
    assert oldest_first, "no prefix came back from the disk tier"
    for row in oldest_first:
        assert row["cached_tokens"] >= row["prefix_tokens"] - 16
    assert all(r["cached_tokens"] > 0 for r in rows if r["tier"] != "recompute")
    assert sum(t["hit_rate"] for t in result["tiers"].values()) == pytest.approx(1.0)
    assert result["rates"]["disk_read_bytes_per_s"] > 0
    assert result["rates"]["prefill_tokens_per_s"] > 0
    # the A/B passes after kvstore restarts: prefixes came back from disk both ways
    assert result["overlap"], "no disk hit in the overlap passes"
    for v in result["overlap"].values():
        assert v["disk_hits"]["sequential"] > 0 and v["disk_hits"]["overlapped"] > 0
    assert "crossover" in capsys.readouterr().out


@pytest.mark.parametrize("scenario", ["all", "peer", "engine"])
def test_the_pool_preset_is_refused_by_name_outside_the_tiers_scenario(capsys, scenario) -> None:
    assert main(["bench", "--scenario", scenario, "--preset", "pool"]) != 0
    assert "--preset pool applies to --scenario tiers only" in capsys.readouterr().err
