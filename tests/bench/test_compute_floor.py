"""The compute floor of a cached turn's delta: the FLOPs by hand, the rates' interpolation,
the peer report's cached turns against it, and the rates measured once for real."""

from __future__ import annotations

import math

import pytest

from radixserve.bench.compute_floor import (
    ComputeFloor,
    FloorShape,
    Rates,
    floor_ms,
    measure_compute_floor,
)
from radixserve.bench.peer_report import cached_turn_floor
from radixserve.bench.report import Sample

# the default model (SmolLM2-135M): 106,168,320 parameters in the layer matrices
SMOLLM2 = FloorShape(layer_params=106_168_320, vocab_size=49_152, hidden_size=576,
                     num_heads=9, head_dim=64, num_layers=30)  # fmt: skip
FLAT = Rates(rows=(16,), gemm_gflops=(100.0,), prefix_lens=(2000,), attention_gflops=((40.0,),))


def test_the_floor_of_32_new_tokens_over_2000_cached() -> None:
    # GEMM: 2 × 32 × 106,168,320 + 2 × 49,152 × 576 (the LM head, last row)
    assert SMOLLM2.gemm_flops(32) == 6_794_772_480 + 56_623_104
    # attention: 32 rows × (2000 + 33 / 2) mean keys × 9 heads × 64 × 4 × 30 layers
    assert SMOLLM2.attention_flops(32, 2000) == 32 * 2016.5 * 69_120 == 4_460_175_360
    # at 100 GFLOP/s and 40 GFLOP/s: 68.51395584 ms + 111.504384 ms
    assert floor_ms(SMOLLM2, 32, 2000, 100.0, 40.0) == pytest.approx(180.01833984)
    assert ComputeFloor(SMOLLM2, FLAT).floor_ms(32, 2000) == pytest.approx(180.01833984)


def test_rates_between_and_beyond_the_measured_points() -> None:
    rates = Rates(rows=(16, 64), gemm_gflops=(100.0, 300.0), prefix_lens=(1000, 3000),
                  attention_gflops=((40.0, 80.0), (20.0, 60.0)))  # fmt: skip
    assert rates.gemm(32) == pytest.approx(200.0)  # halfway in log rows
    assert (rates.gemm(8), rates.gemm(128)) == (100.0, 300.0)  # the nearest measured
    assert rates.attention(32, 2000) == pytest.approx(50.0)  # (60 + 40) / 2
    assert rates.attention(32, 500) == pytest.approx(60.0)
    assert rates.attention(16, 5000) == 20.0
    # 6,851,395,584 FLOPs at 200 + 4,460,175,360 at 50
    assert ComputeFloor(SMOLLM2, rates).floor_ms(32, 2000) == pytest.approx(
        34.25697792 + 89.2035072
    )
    assert rates.to_json()["attention_gflops"] == [[40.0, 80.0], [20.0, 60.0]]


def test_the_cached_turns_against_their_floor() -> None:
    samples = [
        Sample(1, 1500, 0, 16, 900.0),  # round 1: not a cached turn
        Sample(2, 2032, 2000, 16, 150.0),  # delta 32 over 2000: 180.01833984 ms
        Sample(3, 2100, 2100, 16, 50.0),  # all cached: the last token still runs
        Sample(3, 2100, 2000, 0, math.nan, error="HTTPStatusError"),  # failed: left out
        Sample(4, 0, 0, 16, 70.0, usage_reported=False),  # no counts: left out
    ]
    turns = cached_turn_floor(samples, ComputeFloor(SMOLLM2, FLAT))
    assert turns is not None
    assert [t["delta_tokens"] for t in turns["per_turn"]] == [32, 1]
    # delta 1 over 2099: 268,959,744 FLOPs at 100 + 2100 × 69,120 at 40
    floors = [180.01833984, 2.68959744 + 3.6288]
    assert [t["floor_ms"] for t in turns["per_turn"]] == pytest.approx(floors)
    assert turns["turns"] == 2 and turns["ttft_ms_mean"] == 100.0
    assert turns["floor_ms_mean"] == pytest.approx(sum(floors) / 2)
    assert turns["ttft_over_floor"] == pytest.approx(100.0 / (sum(floors) / 2))
    assert turns["delta_tokens_mean"] == 16.5 and turns["prompt_tokens_mean"] == 2066
    assert cached_turn_floor(samples[:1], ComputeFloor(SMOLLM2, FLAT)) is None


def test_rates_measured_on_the_default_model() -> None:
    # 16 rows after 48 cached tokens (a 64-token context): a few seconds
    floor, measured = measure_compute_floor("default", [16], [48])
    assert floor.shape == SMOLLM2
    rates = [*floor.rates.gemm_gflops, *floor.rates.attention_gflops[0]]
    assert len(rates) == 2 and all(math.isfinite(r) and r > 0 for r in rates), rates
    assert 0 < floor.floor_ms(16, 48) < math.inf
    assert measured["torch_threads"] >= 1 and measured["seconds"] > 0
