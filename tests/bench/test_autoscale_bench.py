"""`radixserve bench --scenario autoscale`: the simulator runs the autoscaler's own
policy and the baselines over a trace, and its accounting is what it claims (every
request served once, replica-seconds integrate the pools, static pools never move,
infeasible requests counted by their own prefill, the smallest static pool found by
bisection); the report names the infeasible share and the remedies; the long-tailed
generated trace has its tail and its prefix reuse; the trace file format reads back what
was written and refuses malformed lines by number; the autoscale flags are refused
elsewhere and bad values by name."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from radixserve.bench.autoscale import (
    AdviceRecorder,
    StaticPolicy,
    policy_settings,
    smallest_static_pool,
)
from radixserve.bench.autoscale_sim import PoolModel, SimResult, Simulator
from radixserve.bench.autoscale_trace import (
    LongTailShape,
    TraceRequest,
    long_tail_trace,
    read_trace,
    write_trace,
)
from radixserve.cli import main
from radixserve.services.autoscaler.policy import ScalingPolicy


def test_autoscale_bench_reads_a_trace_file_and_reports_the_infeasible(
    tmp_path: Path, capsys
) -> None:
    # 2 req/s for 5 min; every tenth a 30k-token prompt: 3.8 s of one replica's compute
    trace = [TraceRequest(t * 0.5, 30000 if t % 10 == 0 else 600, 20, 100) for t in range(600)]
    path = tmp_path / "trace.jsonl"
    write_trace(path, trace)
    out = tmp_path / "autoscale.json"
    assert main(["bench", "--scenario", "autoscale", "--trace", str(path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["requests"] == 600
    policies = report["policies"]
    assert set(policies) == {"autoscaler", "static-peak", "naive-reactive", "smallest-static"}
    for p in policies.values():
        assert 0 <= p["attainment"] <= min(p["ttft_attainment"], p["itl_attainment"]) <= 1
        assert p["attainment"] <= min(0.9 + 1e-9, p["feasible_attainment"])  # 10 % can't
    static = policies["static-peak"]
    assert static["scale_events"] == {"prefill": 0, "decode": 0}
    # static pools are held for the whole trace (plus the drain of the last requests)
    for role in ("prefill", "decode"):
        seconds = static["replica_seconds"][role]
        assert static["pools"][role] * 299.5 <= seconds <= static["pools"][role] * 320
    smallest = policies["smallest-static"]
    assert smallest["feasible_attainment"] >= policies["autoscaler"]["feasible_attainment"]
    assert smallest["replica_seconds_total"] <= static["replica_seconds_total"]
    infeasible = report["infeasible"]
    assert infeasible["requests"] == 60 and infeasible["over_uncached_tokens"] == 7840
    assert "8,000 tokens/s" in infeasible["why"]
    assert report["advice"]["advised"] and report["advice"]["autoscaler_intervals"]["prefill"] > 0
    assert out.with_suffix(".png").stat().st_size > 10_000
    text = capsys.readouterr().out
    assert "| autoscaler |" in text and "infeasible: 60 requests (10.0%)" in text
    assert "--prefill-tp" in text and "TTFT_PER_1K_TOKENS_S" in text


def test_the_simulator_counts_a_request_infeasible_by_its_own_prefill() -> None:
    # 7,840 uncached tokens take 0.98 s + 20 ms: exactly the 1 s target; one more does not
    trace = [TraceRequest(0.0, 7840, 2), TraceRequest(5.0, 7841, 2), TraceRequest(10.0, 800, 2)]
    sim = Simulator(trace, StaticPolicy(), PoolModel(), {"prefill": 1, "decode": 1}, 10.0,
                    (1.0, 0.05))  # fmt: skip
    result = sim.run()
    assert result.infeasible == 1 and result.feasible_attainment == 1.0
    assert result.attainment == pytest.approx(2 / 3)
    assert sum(p["infeasible_per_s"] for p in result.timeline) * 10.0 == 1
    # a per-token budget of 0.2 s per 1k tokens makes it feasible (and on time)
    sim = Simulator(trace, StaticPolicy(), PoolModel(), {"prefill": 1, "decode": 1}, 10.0,
                    (1.0, 0.05), ttft_per_1k_s=0.2)  # fmt: skip
    assert sim.run().attainment == 1.0


def test_the_autoscaler_does_not_scale_prefill_for_infeasible_requests_in_simulation() -> None:
    # 10 minutes of 40k-token prompts every 10 s (4k tokens/s: half a replica's work),
    # every one infeasible; 2 prefill replicas to start with
    trace = [TraceRequest(t * 10.0, 40000, 20) for t in range(60)]
    recorder = AdviceRecorder(ScalingPolicy(policy_settings()))
    result = Simulator(trace, recorder, PoolModel(), {"prefill": 2, "decode": 1}, 10.0,
                       (1.0, 0.05)).run()  # fmt: skip
    assert result.infeasible == 60 and result.attainment == 0.0
    assert max(p["prefill_replicas"] for p in result.timeline) == 2
    assert recorder.advised_intervals["prefill"] > 50


def test_smallest_static_pool_is_found_by_bisection() -> None:
    calls = []

    def run(pools: dict[str, int]) -> SimResult:  # attainment grows with both pools
        calls.append(pools)
        share = min(1.0, pools["prefill"] / 7) * min(1.0, pools["decode"] / 2)
        return SimResult(100, share, share, share, 0, share, {}, {}, [])

    peak = {"prefill": 10, "decode": 3}
    found = smallest_static_pool(run, 1.0, peak, run(peak))
    assert found is not None and found[0] == {"prefill": 7, "decode": 2}
    assert len(calls) <= 10  # bisection, not a scan
    assert smallest_static_pool(run, 1.01, peak, run(peak)) is None  # nothing reaches it


def test_the_long_tailed_trace_has_its_tail_and_its_prefix_reuse() -> None:
    shape = LongTailShape(duration_s=900.0)
    trace = long_tail_trace(shape, seed=3)
    assert trace == long_tail_trace(shape, seed=3)  # deterministic for a seed
    assert [r.t for r in trace] == sorted(r.t for r in trace)
    inputs = [r.input_tokens for r in trace]
    assert 2000 < len(trace) < 4000  # 2 to 4.6 requests/s
    assert max(inputs) > 65536 and statistics.median(inputs) < 10000  # a tail past 64k
    reused = sum(r.cached_tokens for r in trace) / sum(inputs)
    assert 0.2 < reused < 0.6  # earlier conversations' prompts and answers, cached
    assert all(r.cached_tokens < r.input_tokens <= shape.max_prompt_tokens for r in trace)


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


def test_the_autoscale_flags_are_checked(tmp_path: Path, capsys) -> None:
    refused = [
        (["--scenario", "engine", "--trace-shape", "long-tail"],
         "--trace-shape applies to --scenario autoscale only"),
        (["--scenario", "gateway", "--trace", "x.jsonl"],
         "--trace applies to --scenario autoscale only"),
        (["--scenario", "autoscale", "--trace", "x.jsonl", "--trace-shape", "diurnal"],
         "--trace reads one: give one"),
        (["--scenario", "autoscale", "--ttft-per-1k-tokens-s", "-1"],
         "--ttft-per-1k-tokens-s must be in (0, 3600]"),
    ]  # fmt: skip
    for flags, message in refused:
        assert main(["bench", *flags]) == 1
        assert message in capsys.readouterr().err
    missing = tmp_path / "missing.jsonl"
    assert main(["bench", "--scenario", "autoscale", "--trace", str(missing)]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
