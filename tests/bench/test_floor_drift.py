"""`bench/floor_drift.py`: its summary math, and two short rounds on the default model
whose floors are the rounds' own bytes over their own bandwidth."""

from __future__ import annotations

import math

import pytest

import bench.floor_drift as drift
from bench.floor_drift import rounds, summary
from radixserve.bench.memory_floor import floor_ms


def test_summary_ranges_the_count_within_2x_and_the_correlation():
    rows = [
        {"copy_gbs": 30.0, "floor_ms": 5.0, "step_ms": 8.0, "step_over_floor": 1.6},
        {"copy_gbs": 45.0, "floor_ms": 3.5, "step_ms": 8.4, "step_over_floor": 2.4},
        {"copy_gbs": 33.0, "floor_ms": 4.6, "step_ms": 7.9, "step_over_floor": 1.72},
    ]
    total = summary(rows)
    assert (total["copy_gbs_min"], total["copy_gbs_max"]) == (30.0, 45.0)
    assert (total["step_ms_min"], total["step_ms_max"]) == (7.9, 8.4)
    assert (total["ratio_min"], total["ratio_max"]) == (1.6, 2.4)
    assert total["rounds_within_2x"] == 2 and total["rounds"] == 3
    assert total["correlation_copy_gbs_step_ms"] > 0.9  # the faster copy, the slower step
    assert math.isnan(summary(rows[:2])["correlation_copy_gbs_step_ms"])


def test_two_rounds_on_the_default_model(monkeypatch: pytest.MonkeyPatch):
    seen: list[float] = []

    def measured() -> float:
        seen.append(30.0 + 10 * len(seen))  # 30, then 40 GB/s: each round its own
        return seen[-1]

    monkeypatch.setattr(drift, "copy_gbs", measured)
    rows = rounds(2, steps=3, context=64)
    assert [r["copy_gbs"] for r in rows] == [30.0, 40.0]
    for row in rows:
        assert row["step_ms"] > 0 and row["context"] > 64
        assert row["step_over_floor"] == row["step_ms"] / row["floor_ms"]
    # each floor: the round's bytes (weights, then the KV of its context: the second
    # round's 3 tokens longer, 23,040 bytes a token) over the round's own bandwidth
    assert _bytes(rows[1]) - _bytes(rows[0]) == pytest.approx(3 * 23040)
    assert rows[1]["floor_ms"] == pytest.approx(floor_ms(0, _bytes(rows[1]), 40.0))


def _bytes(row: dict[str, float]) -> float:
    """The bytes a round's floor reads: floor x bandwidth."""
    return row["floor_ms"] * row["copy_gbs"] * 1e6
