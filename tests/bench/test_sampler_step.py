"""The sampling-step micro-benchmark runs, times both algorithms, and checks on the way
that seeded rows draw the same tokens with each (`bench/sampler_step.py`)."""

from __future__ import annotations

import pytest

from bench.sampler_step import CASES, time_case


@pytest.mark.parametrize("name", ["temperature 0.7, seeded", "mixed"])
def test_a_case_times_both_algorithms_and_their_seeded_draws_agree(name):
    row = time_case(CASES[name], repeats=1)  # raises if a seeded row drew another token
    assert row["new_ms"] > 0 and row["baseline_ms"] > 0
    assert row["ratio"] == row["baseline_ms"] / row["new_ms"]
