"""`radixserve bench --scenario host-tier --quick` end to end on a real local cluster.

The speed ratio is the benchmark's to report (bench/README.md), not this test's to
assert; the test checks that each path is what it claims: the recompute turn caches
nothing, the device turn hits the device, and the host turn's prefix comes from the
host tier (its tokens counted under ``tier="host"``, pages read by the worker). It runs
the tiny random model (``--model``): the paths are the subject, not the model's text,
and the pool is sized by the served model's pages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve.cache.kv_pool import KVPool
from radixserve.cli import main
from tests.engine.engine_helpers import tiny_checkpoint


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_host_tier_bench_quick(tmp_path: Path, capsys, tiny_model: str) -> None:
    out = tmp_path / "host-tier.json"
    argv = ["bench", "--scenario", "host-tier", "--quick", "--model", tiny_model]
    assert main([*argv, "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["scenario"] == "host-tier" and result["prefix_tokens"] == 1024
    (row,) = result["rows"]
    assert row["device_cached_tokens"] >= 1024 - 16  # the document, on the device
    # the host turn shares the same prefix, and it came from the host tier
    assert row["host_cached_tokens"] >= 1024 - 16
    assert (
        row["host_cached_tokens"] + row["host_path_device_cached_tokens"]
        == (row["device_cached_tokens"])
    )
    assert row["host_load_pages"] * 16 >= row["host_cached_tokens"]
    assert row["host_load_bytes"] == row["host_load_pages"] * row["page_bytes"]
    # the worker served --model: the tiny model's fp32 16-token page (8 KiB, not 720)
    assert row["page_bytes"] == KVPool.page_bytes_all_layers(
        tiny_checkpoint().config, 16, torch.float32
    )
    for key in ("recompute", "device", "host"):
        assert result["median_ms"][key] > 0
    assert "host / recompute" in capsys.readouterr().out
