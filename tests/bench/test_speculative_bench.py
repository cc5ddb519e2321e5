"""`--scenario speculative` (`radixserve.bench.speculative`): the quick mode's grid on the
tiny random model writes the document (every method's figures per cell, the counters
that moved, the table and the plot), and speculation's answers are off's."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from radixserve.bench.speculative import run_speculative_bench
from radixserve.bench.speculative_options import QUICK
from radixserve.bench.speculative_workloads import WORKLOADS, build_workload
from radixserve.cli import main
from radixserve.engine.speculation import METHODS
from tests.engine.engine_helpers import TINY, make_engine


def test_the_workloads_are_seeded_and_repeat_text():
    code = build_workload("code-edit", 3, 2).conversations[0].turns[0]([])
    assert code == build_workload("code-edit", 3, 2).conversations[0].turns[0]([])
    assert code != build_workload("code-edit", 4, 2).conversations[0].turns[0]([])
    assert 140 <= code[-1]["content"].count("\n") <= 200  # a file of about 150 lines
    agentic = build_workload("agentic", 0, 1).conversations[0]
    second = agentic.turns[1](["THE FIRST ANSWER"])  # the model's answer goes back in
    assert {"role": "assistant", "content": "THE FIRST ANSWER"} in second
    cross = build_workload("cross-request", 0, 16)
    assert len(cross.primes) == 2  # the first askers, whose answers later askers want again
    asked = [c.turns[0]([])[0]["content"] for c in cross.conversations]
    assert len(set(asked)) == 16  # 8 users a question, each in their own words
    assert not set(asked) & {p.turns[0]([])[0]["content"] for p in cross.primes}
    for name in WORKLOADS:
        assert len(build_workload(name, 0, 5).conversations) == 5


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_quick_grid_writes_the_document_and_answers_match_off(tmp_path, capsys):
    out = tmp_path / "speculative.json"
    # 13 RAG questions of 12: the last asks the first's again, so the tiny model's answer
    # (random weights: no n-gram of its own repeats) is in the radix engines' draft index
    options = replace(QUICK, out_path=out, batch1_conversations=13, max_tokens={"code-edit": 24},
                      default_max_tokens=24)  # fmt: skip

    def tiny(method: str):
        return make_engine(TINY, kv_cache_memory_gib=0.05, speculative_method=method)

    assert run_speculative_bench(options, tiny) == 0  # 1 if an answer differed from off's
    doc = json.loads(out.read_text())
    assert doc["mismatches"] == []
    assert [(c["workload"], c["batch"]) for c in doc["cells"]] == [("code-edit", 1), ("rag", 1)]
    for cell in doc["cells"]:
        assert list(cell["methods"]) == list(METHODS)
        off = cell["methods"]["off"]
        assert off["counters"]["drafted"] == 0 and off["tokens_per_s_vs_off"] == 1.0
        assert off["decode_tokens"] == 13 * 23  # 13 answers of 24 tokens, after the first
        for method in METHODS:
            figures = cell["methods"][method]
            assert figures["decode_tokens"] == off["decode_tokens"]
            assert figures["decode_tokens_per_s"] > 0 and figures["itl_ms"]["p50"] > 0
    rag = doc["cells"][1]["methods"]
    for method in ("radix", "both"):  # the repeated answer was drafted, and verified
        assert rag[method]["counters"]["accepted"] >= 16, rag[method]["counters"]
    for key in ("date_utc", "load_average", "cpu_count"):
        assert key in doc["environment"]
    table = capsys.readouterr().out
    assert "| code-edit | 1 | both |" in table and "differing from off's: 0" in table
    if doc["plot"] is not None:
        assert (tmp_path / "speculative-tokens-per-s.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cpu"], "--device: --scenario speculative builds one engine per"),
        (["--speculative-method", "both"], "--speculative-method: --scenario speculative"),
        (["--no-prefix-cache"], "--no-prefix-cache: --scenario speculative"),
        (["--users", "3"], "--users: --scenario speculative"),
        (["--quantization", "int8"], "--quantization: --scenario speculative runs its own"),
    ],
)
def test_flags_it_does_not_take_are_refused_by_name(flags, message, capsys):
    assert main(["bench", "--scenario", "speculative", *flags]) != 0
    assert message in capsys.readouterr().err


def test_through_cluster_is_refused_elsewhere(capsys):
    assert main(["bench", "--scenario", "engine", "--through-cluster"]) != 0
    assert "--through-cluster applies to --scenario speculative only" in capsys.readouterr().err
