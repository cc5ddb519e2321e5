"""A cached turn's delta: the layers in one native call against their torch ops, in one run.

One engine on the default model and settings (int4 weights, bfloat16). A sequence's
`PREFIX_TOKENS`-token prefix is in its pages; then one step computes a delta of R new
tokens over it (R = 16, 32, 64, 100: a cached turn's new user message, or a prompt's
uncached tail), through the torch layers and through the native step (`FusedDecode`,
its threads as the engine runs it), one forward each in turn (embedding lookup to the
last row's logits), `STEPS` pairs to warm up, then `STEPS` × repeats; medians (and the
fastest, the least disturbed by other processes). Both rewrite the same
slots with the same bits (checked once per R).

Beside them, the step's compute floor (`compute_floor.py`) at rates measured in the same
run: its GEMM FLOPs (2 × R × the layer matrices' parameters, every layer, + 2 × the LM
head's for the last row) at the rate of the layer matrices on R rows, plus its attention
FLOPs (R × the mean keys a row reads × heads × head dim × 4, every layer) at the rate of
the native attention on those R rows over that prefix.

    .venv/bin/python bench/extend_ab.py [--repeats 3] [--out bench/results/extend-ab.json]

Prints one table (ms per step, the ratios) and writes the rows as JSON. Another
process on the machine moves single figures; the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from radixserve.bench.compute_floor import (
    FloorShape,
    attention_gflops,
    delta_batch,
    floor_ms,
    gemm_gflops,
    load_engine,
    median_ms,
    prefix_pages,
)
from radixserve.engine.engine import Engine
from radixserve.model.fused_decode import FusedDecode, fused_decode_for

ROWS = (16, 32, 64, 100)
PREFIX_TOKENS = 2048
STEPS = 8


def measure(
    engine: Engine, fused: FusedDecode, pages: list[int], rows: int, repeats: int
) -> dict[str, float]:
    model = engine.model
    fb = delta_batch(engine, pages, PREFIX_TOKENS, rows)
    assert fused.applies(fb), f"{rows} rows: raise --max-rows"

    def torch_path() -> torch.Tensor:
        return model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn,
                     fb.logits_indices)  # fmt: skip

    assert torch.equal(torch_path(), fused.forward(fb)), "the native step's bits differ"
    times: dict[str, list[float]] = {"torch": [], "native": []}
    for call in range((repeats + 1) * STEPS):  # the first STEPS warm up
        # one call each in turn: a burst of another process's load hits both alike
        for name, fn in (("torch", torch_path), ("native", lambda: fused.forward(fb))):
            ms = median_ms(fn, 1)
            if call >= STEPS:
                times[name].append(ms)
    shape = FloorShape.of(engine)
    gemm_rate, attn_rate = gemm_gflops(engine, rows), attention_gflops(engine, fb)
    return {"rows": rows, "torch ms": statistics.median(times["torch"]),
            "native ms": statistics.median(times["native"]),
            "torch min ms": min(times["torch"]), "native min ms": min(times["native"]),
            "gemm GFLOP/s": gemm_rate, "attention GFLOP/s": attn_rate,
            "gemm GFLOP": shape.gemm_flops(rows) / 1e9,
            "attention GFLOP": shape.attention_flops(rows, PREFIX_TOKENS) / 1e9,
            "floor ms": floor_ms(shape, rows, PREFIX_TOKENS, gemm_rate, attn_rate)}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--max-rows", type=int, default=None,
                        help="a native step with buffers for this many rows (default: the "
                        "engine's)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/extend-ab.json"))
    args = parser.parse_args()
    engine = load_engine("default")
    fused = engine.runner.fused
    assert fused is not None, "the default model takes the native step"
    if args.max_rows is not None:
        fused = fused_decode_for(engine.model, engine.kv_pool.layers, fused.max_batch,
                                 fused.step.threads, max_rows=args.max_rows)  # fmt: skip
        assert fused is not None
    pages = prefix_pages(engine, PREFIX_TOKENS, max(args.rows))  # the cached prefix
    with torch.inference_mode():
        rows = [measure(engine, fused, pages, r, args.repeats) for r in args.rows]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"prefix {PREFIX_TOKENS} tokens; torch threads {torch.get_num_threads()}; "
          f"native buffers {fused.step.buffer_bytes / 1e6:.1f} MB for {fused.step.max_rows} rows")  # fmt: skip
    print("| rows | torch ms | native ms | native / torch | (fastest: torch, native) | "
          "GEMM GFLOP/s | attention GFLOP/s | floor ms | native / floor | torch / floor |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, n, f = r["torch ms"], r["native ms"], r["floor ms"]
        print(f"| {r['rows']} | {t:.2f} | {n:.2f} | {n / t:.2f}x | "
              f"{r['torch min ms']:.2f}, {r['native min ms']:.2f} | {r['gemm GFLOP/s']:.1f} | "
              f"{r['attention GFLOP/s']:.1f} | {f:.2f} | {n / f:.2f}x | {t / f:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
