"""bench/openmp_wait.py runs both policies as it says: the ``spin`` process keeps
libgomp's default (no OMP_WAIT_POLICY, torch imported before radixserve), the
``passive`` one waits passively, and each times a prefill and decoding. Two fresh engine
processes: make bench-test. The ratio is the benchmark's to report (bench/README.md)."""

from __future__ import annotations

import json

import pytest

from radixserve.bench import openmp_wait

pytestmark = pytest.mark.benchmark


def test_each_policy_runs_as_named(tmp_path, capsys) -> None:
    out = tmp_path / "omp.json"
    assert openmp_wait.main(["--repeats", "1", "--tokens", "64", "--out", str(out)]) == 0
    runs = json.loads(out.read_text())["runs"]
    assert runs["spin"][0]["policy"] == ""
    assert runs["passive"][0]["policy"] == "PASSIVE"
    for rows in runs.values():
        assert rows[0]["prefill_ms"] > 0 and rows[0]["itl_ms"] > 0
    assert "passive / spin: prefill" in capsys.readouterr().out
