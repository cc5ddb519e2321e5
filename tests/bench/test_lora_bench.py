"""`--scenario lora` (`radixserve.bench.lora`): a small run on the tiny random model writes
every cell (decode per adapter count, cached chat turns per adapter with the cross-check,
swap-in), its checks catch what they are for, and flags it does not take are refused."""

from __future__ import annotations

import contextlib
import copy
import io
import json
from dataclasses import replace

import pytest

from radixserve.bench.lora import run_lora_bench
from radixserve.bench.lora_engine import QUICK
from radixserve.bench.lora_report import problems
from radixserve.cli import main
from tests.engine.engine_helpers import TINY, make_engine

#: 4 requests of 8 tokens over 0, 1 and 2 adapters (2 slots), 3-turn chats with 2 adapters
TINY_OPTIONS = replace(QUICK, batch=4, decode_tokens=8, adapter_counts=(0, 1, 2), repeats=2,
                       prompt_tokens=16, swap_repeats=2, chat_adapters=2,
                       chat_context_tokens=64, chat_answer_tokens=8)  # fmt: skip


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("lora") / "lora.json"

    def tiny(max_loras: int):
        return make_engine(TINY, kv_cache_memory_gib=0.05, max_loras=max_loras)

    table = io.StringIO()
    with contextlib.redirect_stdout(table):
        code = run_lora_bench(replace(TINY_OPTIONS, out_path=out), tiny)
    return code, json.loads(out.read_text()), out, table.getvalue()


def test_every_cell_is_written_with_sane_figures(run):
    code, doc, out, table = run
    assert code == 0 and doc["problems"] == []
    assert doc["engine"]["max_loras"] == 2 and doc["adapters"]["rank"] == 16
    t = doc["throughput"]
    assert [v["adapters"] for v in t["variants"]] == [0, 1, 2]
    assert t["order"] == [[0, 1, 2], [2, 1, 0]]  # the variants alternate per repeat
    for row in t["variants"]:
        assert row["tokens_per_request"] == [8]  # min_tokens: every request decodes all 8
        assert row["decode_tokens"] == 2 * 4 * 7  # 2 repeats x 4 requests x 7 after the first
        assert row["decode_tokens_per_s"] > 0 and len(row["per_repeat_tokens_per_s"]) == 2
        assert 0 < row["itl_ms"]["p50"] <= row["itl_ms"]["p90"]
        assert row["tokens_per_s_vs_base"] > 0 and row["steps"] >= 2 * 8
        assert len(row["per_repeat_vs_base"]) == 2 and row["median_repeat_vs_base"] > 0
    assert t["variants"][0]["tokens_per_s_vs_base"] == 1.0
    assert t["variants"][0]["per_repeat_vs_base"] == [1.0, 1.0]
    chats = doc["chat"]["conversations"]
    assert [c["adapter"] for c in chats] == ["", "adapter-00", "adapter-01"]
    for chat in chats:
        first, *later = chat["turns"]
        assert len(chat["turns"]) == 3 and first["cached_tokens"] == 0
        for turn in later:  # each turn finds the turns before it in its own adapter's cache
            assert 0 < turn["cached_tokens"] < turn["prompt_tokens"] and turn["ttft_ms"] > 0
    other, base, own = doc["chat"]["cross_check"]
    assert (other["adapter"], base["adapter"], own["adapter"]) == ("adapter-01", "", "adapter-00")
    assert other["cached_tokens"] == 0 and base["cached_tokens"] == 0
    assert own["cached_tokens"] > own["prompt_tokens"] // 2
    divergence = doc["divergence"]["adapters"]  # the adapters change the answer
    assert [r["adapter"] for r in divergence] == ["adapter-00", "adapter-01"]
    assert any(r["first_different_token"] is not None for r in divergence), divergence
    swap = doc["swap"]
    assert swap["slots"] == 2 and swap["adapters_loaded"] == 2 + 2  # 2 fresh ones
    assert [r["copies"] for r in swap["requests"]["first_use"]] == [1, 1]
    assert [r["copies"] for r in swap["requests"]["returning"]] == [1, 1]
    assert [r["copies"] for r in swap["requests"]["resident"]] == [0, 0]
    assert all(r["evicted"] for r in swap["requests"]["first_use"])
    assert all(v > 0 for v in swap["median_ms"].values())
    for key in ("date_utc", "load_average", "load_average_end", "cpu_count"):
        assert key in doc["environment"]
    assert "| 2 |" in table and "checks failed: 0" in table
    if doc["plot"] is not None:
        assert (out.parent / "lora-tokens-per-s.png").stat().st_size > 0


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda d: d["chat"]["cross_check"][0].update(cached_tokens=16), "found 16 tokens"),
        (lambda d: d["chat"]["cross_check"][1].update(cached_tokens=16), "the base model given"),
        (lambda d: d["chat"]["cross_check"][2].update(cached_tokens=0), "none of its own"),
        (lambda d: d["chat"]["conversations"][1]["turns"][2].update(cached_tokens=0), "turn 3"),
        (lambda d: d["throughput"]["variants"][1].update(tokens_per_request=[3, 8]), "decoded"),
        (lambda d: d["swap"]["requests"]["returning"][0].update(copies=0), "swap returning"),
        (
            lambda d: [r.update(first_different_token=None) for r in d["divergence"]["adapters"]],
            "are the adapters applied",
        ),
    ],
)
def test_the_checks_name_what_is_wrong(run, change, named):
    doc = copy.deepcopy(run[1])
    change(doc)
    found = problems(doc)
    assert len(found) == 1 and named in found[0], found


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--device", "cpu"], "--device: --scenario lora builds its engine itself"),
        (["--no-prefix-cache"], "--no-prefix-cache: --scenario lora"),
        (["--quantization", "int8"], "--quantization: --scenario lora runs its own"),
        (["--through-cluster"], "--through-cluster applies to --scenario speculative only"),
    ],
)
def test_flags_it_does_not_take_are_refused_by_name(flags, message, capsys):
    assert main(["bench", "--scenario", "lora", *flags]) != 0
    assert message in capsys.readouterr().err
