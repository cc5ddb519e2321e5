"""`python -m radixserve.bench.gpu --dry-run` (the kernels' benchmark and the engine on
them) runs end to end on CPU (tiny shapes, the Triton interpreter, the engine on random
weights; the tensor-parallel section on two CPU ranks over gloo), so the GPU benchmark
cannot rot unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.benchmark  # a benchmark's own end-to-end run: `make bench-test`
def test_dry_run_covers_every_section(tmp_path):
    out = tmp_path / "bench.json"
    # the script switches the interpreter on itself: none inherited from this directory's tests
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "radixserve.bench.gpu", "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["dry_run"] and result["copy_gbps"] > 0 and result["matmul_tflops"] > 0
    rows = result["rows"]
    sections = {r["section"] for r in rows}
    ops = {"decode_attention", "extend_attention", "rmsnorm+residual", "rope", "silu_and_mul",
           "store_kv", "pack_pages", "unpack_pages", "fp8_linear", "fused_moe"}  # fmt: skip
    assert ops <= sections and "engine" in sections and "error" not in sections
    for r in rows:
        if r["section"] in ops:
            assert r["triton_us"] > 0 and r["reference_us"] > 0 and r["of_ceiling"] > 0, r
        if r["section"] in ("decode_attention", "extend_attention"):
            assert r["sdpa_us"] > 0, r
    cached = [r for r in rows if r["extra"].get("cached_tokens")]
    assert [r["extra"]["cached_tokens"] for r in cached] == [64, 128]
    assert sum(r["section"] == "target" for r in rows) == 3
    # tensor parallelism: all-reduce on two gloo ranks, and the engine at TP=2 vs TP=1
    reduces = [r for r in rows if r["section"] == "tp"]
    assert len(reduces) == 2 and all(r["extra"]["ranks"] == 2 for r in reduces), reduces
    assert all(r["reference_us"] > 0 and r["extra"]["bus_gbps"] > 0 for r in reduces)
    [tp] = [r for r in rows if r["case"].startswith("TP=2 vs TP=1")]
    rates = (tp["extra"]["prefill_tokens_per_s"], tp["extra"]["decode_tokens_per_s"])
    assert all(r[k] > 0 for r in rates for k in ("tp1", "tp2")), tp
    assert "| section | case |" in proc.stdout and "dry run" in proc.stdout
