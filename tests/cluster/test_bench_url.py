"""`radixserve bench --url`: the benchmark suite run against a cluster already up (the
shared ``default-tiny`` cluster, the tiny model: the subject is the benchmark's
measuring; the suite's own local runs are tests/bench/test_suite.py)."""

from __future__ import annotations

import json

from radixserve.bench.report import plot_paths
from radixserve.cli import main

SHARED_CLUSTER = "default-tiny"  # shared with other modules: tests/cluster/conftest.py


def test_suite_against_url(cluster, tmp_path, capsys):
    """--url: one run against a server already up; every cache-off value is null. Also
    the CLI path, and one scenario's JSON being the object itself."""
    out = tmp_path / "url.json"
    code = main(["bench", "--scenario", "rag", "--quick", "--users", "2",
                 "--url", f"{cluster.url}/v1", "--out", str(out)])  # fmt: skip
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["scenario"] == "rag" and doc["settings"]["cache_off_run"] is False
    [row] = doc["rounds"]
    assert row["off"] is None and row["on"]["requests"] == 2 and row["on"]["cached_tokens"] > 0
    s = doc["summary"]
    assert s["ttft_cut_pct"] is None and s["prefill_compute_cut_pct"] is None
    assert s["qps_off"] is None and s["qps_gain"] is None and s["qps_on"] > 0
    assert all(p.exists() for p in plot_paths(out, "rag"))
    assert "off columns are empty" in capsys.readouterr().out
