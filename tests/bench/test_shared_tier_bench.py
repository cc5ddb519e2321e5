"""`radixserve bench --scenario shared-tier --quick` end to end on a real local cluster.

The speed ratios are the benchmark's to report (bench/README.md), not this test's to
assert; the test checks that each path is what it claims: the drained worker's
conversation continued on the other decode worker from the peer tier (at least 90 % of
the prompt cached, counted under ``tier="peer"``, pages read by that worker), the local
hit (the same turn of a twin conversation on its own worker) had its prefix cached, the
prompt repeated was read from a peer by the restarted owner and then hit the device of
the worker holding it, the recompute cached nothing, and the kvstore answered the index queries (naming the worker that
holds the prompt); then the two-node part: the conversation read from the other node,
host-tier hits from the remote and the local node's tier, the index over 1 and 3
kvstores. It runs the tiny random model (``--model``): the paths are the
subject, not the model's text. The table and flag checks run in `make test`; the
end-to-end run is a `benchmark` (`make bench-test`, ~30 s on 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from radixserve.bench.shared_tier import summarise
from radixserve.bench.shared_tier_report import format_table
from radixserve.cli import main


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_shared_tier_bench_quick(tmp_path: Path, capsys, tiny_model: str) -> None:
    out = tmp_path / "shared-tier.json"
    argv = ["bench", "--scenario", "shared-tier", "--quick", "--model", tiny_model]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["scenario"] == "shared-tier" and result["preset"] == "quick"
    (row,) = result["rows"]
    assert {row["owner"], row["reader"]} == {"decode-0", "decode-1"}
    assert row["owner_turns"] == 3  # the three turns stayed on one worker
    prompt = row["prompt_tokens"]
    assert prompt > 3000
    # the peer turn: cached from the drained worker's pages, read by the other worker
    assert row["peer_cached_tokens"] >= 0.9 * prompt, row
    assert row["peer_tier_tokens"] >= 0.9 * prompt, row
    assert row["peer_read_pages"] * 16 >= row["peer_tier_tokens"]
    assert row["reader_counters"]["peer_read_failures_total"] == 0
    # the local hit: turn 4 of a twin conversation on its own worker, its prefix cached
    # as the peer turn's was
    assert row["local_cached_tokens"] >= 0.9 * row["local_prompt_tokens"]
    # the prompt repeated: from the worker that holds it (all but its last page), then by
    # the restarted owner from that worker once it drains (as much, from the peer tier)
    assert row["repeat_cached_tokens"] >= prompt - 16
    assert row["repeat_peer_cached_tokens"] >= prompt - 16, row
    assert row["repeat_peer_tier_tokens"] >= prompt - 16, row
    assert row["recompute_cached_tokens"] == 0
    # the gateway kept the turns' traces: the peer read under the reader's admission
    assert 0 < row["peer_read_span_ms"] <= row["peer_admission_ms"]
    for key in ("peer", "local", "repeat_peer", "repeat", "recompute"):
        assert result["median_ms"][key] > 0
    assert result["peer_cached_share"] >= 0.9
    index = result["index_query"]
    assert index["shards"] == 1 and index["round_trips"] == 50
    assert index["hashes"] == index["prompt_tokens"] // 16
    assert index["median_ms"] > 0
    # the index knows who holds the prompt now: the owner (it read the repeat from the
    # reader, which has restarted since with its cache empty), most of it on device
    assert index["device_pages"].get(row["owner"], 0) >= 0.9 * index["hashes"], index
    assert "peer / local hit" in capsys.readouterr().out
    # two nodes: the drained conversation read from the other node's worker; the host
    # tier's hits from the other node's tier and from the worker's own; the index over 1
    # and 3 kvstores
    nodes = result["other_node"]
    (peer,) = nodes["peer_rows"]
    assert peer["peer_cached_tokens"] >= 0.9 * peer["prompt_tokens"], peer
    assert peer["peer_read_pages"] * 16 >= peer["peer_tier_tokens"] >= 0.9 * peer["prompt_tokens"]
    (host,) = nodes["host_rows"]
    assert host["remote_loads"] == 1
    assert host["remote_host_tokens"] >= 0.9 * host["prompt_tokens"], host
    assert host["local_host_tokens"] >= 0.9 * host["prompt_tokens"], host
    assert host["recompute_cached_tokens"] == 0
    assert [q["shards"] for q in nodes["index_shards"]] == [1, 3]
    assert all(q["median_ms"] > 0 for q in nodes["index_shards"])


def test_the_table_reports_ratios_beside_the_targets() -> None:
    row = {"conversation": 1, "prompt_tokens": 3100, "peer_ttft_ms": 300.0,
           "peer_cached_tokens": 3072, "peer_tier_tokens": 3056, "peer_read_pages": 191,
           "peer_read_ms": 40.0, "peer_admission_ms": 45.0, "local_ttft_ms": 250.0,
           "local_cached_tokens": 3072, "repeat_peer_ttft_ms": 160.0, "repeat_ttft_ms": 128.0,
           "recompute_ttft_ms": 6000.0}  # fmt: skip
    index = {"shards": 1, "round_trips": 50, "hashes": 193, "median_ms": 0.4, "p90_ms": 0.6}
    result = summarise([row], index, "quick", "default", "nixl")
    assert result["peer_over_local"] == pytest.approx(1.2)
    assert result["peer_over_recompute"] == pytest.approx(0.05)
    assert result["repeat_peer_over_repeat"] == pytest.approx(1.25)
    assert result["peer_cached_share"] == pytest.approx(3072 / 3100)
    table = format_table(result)
    assert "peer / local hit (the next turn) = 1.20 (target <= 1.5)" in table
    assert "peer / local (the prompt repeated) = 1.25 (target <= 1.5)" in table
    assert "peer / recompute = 0.050 (target <= 0.3)" in table
    assert "index query, 1 shard: median 0.40 ms" in table
    assert (
        "| 1 | 3100 | 300 | 3072 | 3056 | 191 | 40.0 | 45 | 250 | 3072 | 160 | 128 | 6000 |"
        in table
    )


@pytest.mark.parametrize(
    "flags", [["--device", "cpu"], ["--decode", "3"], ["--quantization", "int4"]]
)
def test_flags_the_scenario_does_not_take_are_refused_by_name(capsys, flags) -> None:
    assert main(["bench", "--scenario", "shared-tier", *flags]) != 0
    assert flags[0] in capsys.readouterr().err


def test_the_two_node_part_reports_its_ratios() -> None:
    from radixserve.bench.shared_tier_report import format_other_node, summarise_other_node

    peer = {"peer_ttft_ms": 330.0, "local_ttft_ms": 300.0, "recompute_ttft_ms": 6600.0,
            "repeat_peer_ttft_ms": 140.0, "repeat_ttft_ms": 100.0,
            "peer_cached_tokens": 3000, "prompt_tokens": 3100}  # fmt: skip
    host = {"remote_ttft_ms": 400.0, "local_ttft_ms": 320.0, "recompute_ttft_ms": 6400.0}
    shards = [{"shards": 1, "median_ms": 0.3, "p90_ms": 0.4, "round_trips": 50, "hashes": 193},
              {"shards": 3, "median_ms": 0.6, "p90_ms": 0.8, "round_trips": 50, "hashes": 193}]  # fmt: skip
    result = summarise_other_node([peer], [host], shards)
    assert result["peer_over_local"] == pytest.approx(1.1)
    assert result["repeat_peer_over_repeat"] == pytest.approx(1.4)
    assert result["remote_over_local_host"] == pytest.approx(1.25)
    assert result["remote_host_over_recompute"] == pytest.approx(0.0625)
    lines = "\n".join(format_other_node(result))
    assert "peer / local hit (the next turn) = 1.10 (target <= 1.5)" in lines
    assert "peer / local (the prompt repeated) = 1.40 (target <= 1.5)" in lines
    assert "remote / local = 1.25, remote / recompute = 0.062" in lines
    assert "index over 3 shard(s), every shard asked at once: median 0.60 ms" in lines
