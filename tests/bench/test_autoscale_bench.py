"""`radixserve bench --scenario autoscale`: the simulator runs the autoscaler's own
policy and the two baselines over a trace, and its accounting is what it claims (every
request served once, replica-seconds integrate the pools, static pools never move); the
trace file format reads back what was written and refuses malformed lines by number."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench.autoscale import StaticPolicy
from radixserve.bench.autoscale_sim import PoolModel, Simulator
from radixserve.bench.autoscale_trace import TraceRequest, read_trace, write_trace
from radixserve.cli import main


def test_autoscale_bench_quick(tmp_path: Path, capsys) -> None:
    trace = [TraceRequest(t * 0.5, 600, 20, 100) for t in range(600)]  # 2 req/s, 5 min
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    out = tmp_path / "autoscale.json"
    assert main(["bench", "--scenario", "autoscale", "--trace", str(path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 600
    policies = report["policies"]
    assert set(policies) == {"autoscaler", "static-peak", "naive-reactive"}
    for p in policies.values():
        assert 0 <= p["attainment"] <= min(p["ttft_attainment"], p["itl_attainment"]) <= 1
    static = policies["static-peak"]
    assert static["scale_events"] == {"prefill": 0, "decode": 0}
    # static pools are held for the whole trace (plus the drain of the last requests)
    sizes = report["static_peak_sizes"]
    for role in ("prefill", "decode"):
        seconds = static["replica_seconds"][role]
        assert sizes[role] * 299.5 <= seconds <= sizes[role] * 320
    assert out.with_suffix(".png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "| autoscaler |" in text and "static-peak" in text


def test_a_light_load_is_served_within_its_slo_by_one_replica_each() -> None:
    trace = [TraceRequest(t * 1.0, 800, 10, 0) for t in range(120)]
    sim = Simulator(trace, StaticPolicy(), PoolModel(), {"prefill": 1, "decode": 1}, 10.0,
                    (1.0, 0.05))  # fmt: skip
    result = sim.run()
    assert result.requests == 120 and result.attainment == 1.0
    assert len(sim._done) == 120  # each served exactly once


def test_trace_files_round_trip_and_bad_lines_are_named(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    reqs = [TraceRequest(2.0, 100, 5, 50), TraceRequest(1.0, 10, 1)]
    write_trace(path, reqs)
    assert read_trace(path) == sorted(reqs, key=lambda r: r.t)
    path.write_text('# a comment\n\n{"t": 1, "input_tokens": 5, "output_tokens": 2}\n{"t": 2}\n')
    with pytest.raises(ValueError, match=r"t.jsonl:4: not a trace line"):
        read_trace(path)
    path.write_text('{"t": -1, "input_tokens": 5, "output_tokens": 2}\n')
    with pytest.raises(ValueError, match=r":1: negative time"):
        read_trace(path)
