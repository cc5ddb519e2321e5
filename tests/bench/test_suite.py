"""The benchmark suite (`radixserve bench --scenario multi-turn|rag|all`).

Fast unit tests of the workload generator, the summary math and the flags; then the
`quick` preset shrunk to its smallest size, end to end on real local clusters (cache on
and off) of the tiny random model (`--model`: the machinery is the subject, not the
answers), whose JSON is checked for shape and self-consistency. The run against a
server already up (``--url``) is tests/cluster/test_bench_url.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from radixserve.bench.cli import suite_options
from radixserve.bench.report import (
    ModelShape,
    Sample,
    ScenarioRun,
    build_result,
    cut_pct,
    markdown,
    percentile,
    plot_paths,
    prefill_flops,
)
from radixserve.bench.suite import SCENARIOS, SuiteOptions, run_suite
from radixserve.bench.workload import (
    PRESETS,
    MultiTurnSize,
    RagSize,
    build_multi_turn,
    build_rag,
    take_tokens,
)
from radixserve.cli import make_parser


def words(text: str) -> int:
    """A stand-in tokenizer: one token per word or punctuation mark."""
    return len(re.findall(r"\w+|[^\w\s]", text))


# --- workload ---------------------------------------------------------------------------

MT = MultiTurnSize(system_tokens=300, rounds=5, conversations=3, user_tokens=(20, 60),
                   answer_tokens=(50, 150))  # fmt: skip
RAG = RagSize(num_docs=5, doc_tokens_total=1000, users=7, question_tokens=(10, 25),
              answer_tokens=(20, 40))  # fmt: skip


def test_take_tokens_longest_prefix_that_fits():
    text = "one two three four five"
    assert take_tokens(text, 3, words) == "one two three"
    assert take_tokens(text, 100, words) == text
    assert take_tokens(text, 0, words) == "one"  # at least one word
    assert take_tokens("a, b, c", 3, words) == "a,"
    assert take_tokens("a bb c", 1, words, at_least=2) == "a bb"


def test_multi_turn_lengths_in_range():
    wl = build_multi_turn(MT, seed=1, count_tokens=words)
    assert MT.system_tokens - 10 <= words(wl.system) <= MT.system_tokens
    assert len(wl.conversations) == 3 and all(len(c) == 5 for c in wl.conversations)
    for turn in (t for c in wl.conversations for t in c):
        assert 20 <= words(turn.user) <= 60, turn.user
        assert 50 <= turn.answer_tokens <= 150
    assert len({c[0].user for c in wl.conversations}) == 3  # conversations differ


def test_rag_lengths_in_range():
    wl = build_rag(RAG, seed=1, count_tokens=words)
    assert len(wl.documents) == 5 and len(wl.questions) == 7
    for doc in wl.documents:
        assert 190 <= words(doc) <= 200
    assert all(doc in wl.system for doc in wl.documents)
    for q in wl.questions:
        assert 10 <= words(q.user) <= 25, q.user
        assert 20 <= q.answer_tokens <= 40


def test_workload_is_deterministic_by_seed():
    assert build_multi_turn(MT, 3, words) == build_multi_turn(MT, 3, words)
    assert build_rag(RAG, 3, words) == build_rag(RAG, 3, words)
    assert build_multi_turn(MT, 3, words) != build_multi_turn(MT, 4, words)
    assert build_rag(RAG, 3, words) != build_rag(RAG, 4, words)


# --- summary math -----------------------------------------------------------------------

SHAPE = ModelShape(non_embedding_params=100, num_layers=2, attn_dim=10)


def test_percentile_interpolates_like_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 90) == 7.0
    assert percentile([4, 1, 3, 2], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 90) == pytest.approx(3.7)
    assert percentile(list(range(11)), 90) == pytest.approx(9.0)


def test_cut_pct():
    assert cut_pct(25.0, 100.0) == pytest.approx(75.0)
    assert cut_pct(100.0, 100.0) == 0.0
    assert cut_pct(1.0, None) is None and cut_pct(None, 5.0) is None and cut_pct(1.0, 0.0) is None


def test_prefill_flops_counts_computed_positions():
    # 3 tokens from scratch: 2·100·3 + 2·2·10·(1+2+3)
    assert prefill_flops(3, 0, SHAPE) == 600 + 240
    # positions 3 and 4 of a 5-token prompt: 2·100·2 + 2·2·10·(4+5)
    assert prefill_flops(5, 3, SHAPE) == 400 + 360
    assert prefill_flops(5, 5, SHAPE) == 0


def _sample(round_: int, prompt: int, cached: int, ttft: float) -> Sample:
    return Sample(round_, prompt, cached, 4, ttft, itl_ms=[10.0, 30.0])


def test_build_result_summary():
    header = {"scenario": "multi-turn", "preset": "quick", "machine": {}, "model": {"name": "m"},
              "settings": {"description": "test"}}  # fmt: skip
    on = ScenarioRun([_sample(1, 100, 0, 400.0), _sample(2, 200, 96, 50.0),
                      _sample(2, 200, 96, 70.0)], wall_s=2.0, floor_ms=40.0)  # fmt: skip
    off = ScenarioRun([_sample(1, 100, 0, 400.0), _sample(2, 200, 0, 900.0),
                       _sample(2, 200, 0, 1100.0)], wall_s=6.0)  # fmt: skip
    result = build_result(header, on, off, SHAPE)
    r2 = result["rounds"][1]
    assert r2["round"] == 2 and r2["on"]["ttft_ms"] == {"mean": 60.0, "p50": 60.0, "p90": 68.0}
    assert r2["on"]["prefill_computed_tokens"] == 208 and r2["on"]["cached_tokens"] == 192
    assert r2["on"]["itl_ms"] == {"mean": 20.0, "p90": pytest.approx(30.0)}
    s = result["summary"]
    assert s["ttft_cut_pct"] == pytest.approx(100 * (1 - 60 / 1000))
    flops_on = prefill_flops(100, 0, SHAPE) + 2 * prefill_flops(200, 96, SHAPE)
    flops_off = prefill_flops(100, 0, SHAPE) + 2 * prefill_flops(200, 0, SHAPE)
    assert s["prefill_compute_cut_pct"] == pytest.approx(100 * (1 - flops_on / flops_off))
    assert (s["qps_on"], s["qps_off"], s["qps_gain"]) == (1.5, 0.5, 3.0)
    assert s["floor_ms"] == 40.0 and s["cached_ttft_vs_floor"] == pytest.approx(1.5)
    assert s["founding"]["round"] == 12 and s["founding"]["ttft_cut_pct"] == 99.1
    table = markdown(result)
    assert "| 2 | 200 | 96 | 1000 / 1000 / 1080 | 60 / 60 / 68 | 94.0 % |" in table
    assert "founding table (round 12) | 99.1 % | 94.6 % | — | 5.8× |" in table

    alone = build_result(header, on, None, SHAPE)  # --url: no cache-off run
    assert all(r["off"] is None for r in alone["rounds"])
    s = alone["summary"]
    assert (
        s["ttft_cut_pct"] is s["prefill_compute_cut_pct"] is s["qps_off"] is s["qps_gain"] is None
    )
    assert "off columns are empty" in markdown(alone)


# --- flags ------------------------------------------------------------------------------


def test_suite_flags():
    args = make_parser().parse_args(
        ["bench", "--scenario", "all", "--preset", "quick", "--conversations", "3",
         "--rounds", "2", "--users", "5", "--concurrency", "2", "--seed", "7",
         "--decode", "2", "--out", "x/y.json"]
    )  # fmt: skip
    o = suite_options(args)
    assert o.scenarios == SCENARIOS and o.preset_name == "quick" and o.seed == 7
    assert (o.preset.multi_turn.conversations, o.preset.multi_turn.rounds) == (3, 2)
    assert (o.preset.rag.users, o.preset.rag.concurrency, o.preset.multi_turn.concurrency) == (
        5,
        2,
        2,
    )
    assert o.preset.multi_turn.system_tokens == PRESETS["quick"].multi_turn.system_tokens
    assert (o.num_prefill, o.num_decode, o.url, o.out_path) == (1, 2, None, Path("x/y.json"))
    o = suite_options(make_parser().parse_args(["bench", "--scenario", "rag", "--quick"]))
    assert o.scenarios == ("rag",) and o.preset == PRESETS["quick"]
    assert o.out_path == Path("bench/results/suite-rag-quick.json")
    o = suite_options(make_parser().parse_args(["bench", "--scenario", "multi-turn"]))
    assert o.preset_name == "seed" and o.preset.multi_turn.system_tokens == 1500


# --- end to end -------------------------------------------------------------------------

TINY = replace(
    PRESETS["quick"],
    multi_turn=MultiTurnSize(64, rounds=2, conversations=2, user_tokens=(8, 12),
                             answer_tokens=(4, 4)),
    rag=RagSize(2, 64, users=3, question_tokens=(6, 10), answer_tokens=(4, 4), concurrency=2),
    kv_cache_gib=0.02,  # ~2,600 pages of the tiny model (8 KiB each)
)  # fmt: skip
MODE_KEYS = {"ttft_ms", "prefill_computed_tokens", "cached_tokens", "itl_ms",  # required
             "prompt_tokens", "requests", "prefill_gflops"}  # documented extras  # fmt: skip
SUMMARY_KEYS = {"ttft_cut_pct", "prefill_compute_cut_pct", "qps_on", "qps_off", "qps_gain",
                "floor_ms", "cached_ttft_ms", "cached_ttft_vs_floor", "founding"}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory, tiny_model: str):
    # the tiny random model: the JSON's shape and sums are the subject, not the answers
    out = tmp_path_factory.mktemp("suite") / "tiny.json"
    env = {"RADIXSERVE_DEVICE": "cpu", "RADIXSERVE_DTYPE": "float32"}
    options = SuiteOptions(SCENARIOS, "quick", TINY, out, model=tiny_model, engine_env=env)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        doc = run_suite(options)
    return out, doc, printed.getvalue()


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_suite_json_shape(tiny_run):
    out, doc, _ = tiny_run
    assert json.loads(out.read_text()) == doc
    assert set(doc) == {"scenarios"}  # --scenario all: {"scenarios": [one object each]}
    assert [s["scenario"] for s in doc["scenarios"]] == ["multi-turn", "rag"]
    for result in doc["scenarios"]:
        assert set(result) == {"scenario", "preset", "machine", "model", "settings", "rounds",
                               "summary"}  # fmt: skip
        assert result["preset"] == "quick" and result["settings"]["cache_off_run"] is True
        # the model served (its name from the gateway) and its shape (from --model)
        assert result["model"]["name"] == "tiny-smollm2" and result["model"]["num_layers"] == 2
        assert set(result["summary"]) == SUMMARY_KEYS
        for row in result["rounds"]:
            assert set(row) == {"round", "on", "off"}
            for mode in ("on", "off"):
                assert set(row[mode]) == MODE_KEYS
                assert set(row[mode]["ttft_ms"]) == {"mean", "p50", "p90"}
                assert set(row[mode]["itl_ms"]) == {"mean", "p90"}
    multi_turn, rag = doc["scenarios"]
    assert [r["round"] for r in multi_turn["rounds"]] == [1, 2]
    assert [r["round"] for r in rag["rounds"]] == [1]


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_suite_numbers_are_consistent(tiny_run):
    _, doc, _ = tiny_run
    for result in doc["scenarios"]:
        requests = 2 if result["scenario"] == "multi-turn" else 3
        for row in result["rounds"]:
            on, off = row["on"], row["off"]
            for m in (on, off):
                assert m["requests"] == requests
                assert m["prefill_computed_tokens"] + m["cached_tokens"] == m["prompt_tokens"]
                assert 0 < m["ttft_ms"]["p50"] <= m["ttft_ms"]["p90"]
                assert m["itl_ms"]["mean"] > 0  # 4-token answers: 3 gaps each
            assert on["prompt_tokens"] == off["prompt_tokens"]  # the off run replays answers
            assert off["cached_tokens"] == 0
            if result["scenario"] == "rag" or row["round"] >= 2:
                assert on["cached_tokens"] > 0
                assert on["prefill_gflops"] < off["prefill_gflops"]
        s = result["summary"]
        assert s["prefill_compute_cut_pct"] > 0 and s["ttft_cut_pct"] is not None
        assert s["qps_on"] > 0 and s["qps_off"] > 0
        assert s["qps_gain"] == pytest.approx(s["qps_on"] / s["qps_off"])
        assert s["floor_ms"] > 0 and s["cached_ttft_vs_floor"] > 0
    mt_rounds = doc["scenarios"][0]["rounds"]
    assert mt_rounds[1]["on"]["prompt_tokens"] > mt_rounds[0]["on"]["prompt_tokens"]


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_suite_writes_plots_and_prints_table(tiny_run):
    out, doc, printed = tiny_run
    for name in SCENARIOS:
        for path in plot_paths(out, name):
            data = path.read_bytes()
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, path
        assert f"### {name} (quick)" in printed
    assert printed.count("| round | prompt tokens |") == 2
    assert "| founding table (round 12) | 99.1 % |" in printed
