"""A cached turn's delta: the layers in one native call against their torch ops, in one run.

One engine on the default model and settings (int4 weights, bfloat16). A sequence's
`PREFIX_TOKENS`-token prefix is in its pages; then one step computes a delta of R new
tokens over it (R = 16, 32, 64, 100: a cached turn's new user message, or a prompt's
uncached tail), through the torch layers and through the native step (`FusedDecode`,
its threads as the engine runs it), one forward each in turn (embedding lookup to the
last row's logits), `STEPS` pairs to warm up, then `STEPS` × repeats; medians (and the
fastest, the least disturbed by other processes). Both rewrite the same
slots with the same bits (checked once per R).

Beside them, the step's compute floor at rates measured in the same run: its GEMM FLOPs
(2 × R × the layer matrices' parameters, every layer, + 2 × the LM head's for the last
row) at the rate of the layer matrices on R rows, plus its attention FLOPs (R × the mean
keys a row reads × heads × head dim × 4, every layer) at the rate of the native
attention on those R rows over that prefix.

    .venv/bin/python bench/extend_ab.py [--repeats 3] [--out bench/results/extend-ab.json]

Prints one table (ms per step, the ratios) and writes the rows as JSON. Another
process on the machine moves single figures; the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.engine.engine import Engine
from radixserve.kernels.cpu.attention import extend_attention
from radixserve.model.forward_batch import ForwardBatch, SequenceChunk, build_forward_batch
from radixserve.model.fused_decode import FusedDecode, fused_decode_for
from radixserve.settings import EngineSettings

ROWS = (16, 32, 64, 100)
PREFIX_TOKENS = 2048
STEPS = 8


def median_ms(fn: Callable[[], object], calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def gemm_gflops(engine: Engine, rows: int) -> float:
    """The layer matrices' rate on `rows` rows (layer 0's four, as the torch path calls them)."""
    layer = engine.model.decoder_layers[0]
    flops, ms = 0, 0.0
    for proj in (layer.qkv, layer.o_proj, layer.gate_up, layer.down):
        x = torch.randn(rows, proj.in_features).to(torch.bfloat16)  # (R, K)
        proj(x)
        ms += median_ms(functools.partial(proj, x), 20)
        flops += 2 * rows * proj.in_features * proj.out_features
    return flops / ms / 1e6


def attention_gflops(engine: Engine, fb: ForwardBatch, context: float) -> float:
    """The native attention's rate on the step's rows over their keys (layer 0's pool)."""
    layer, meta = engine.model.decoder_layers[0], fb.attn
    rows, (k, v) = fb.input_ids.shape[0], engine.kv_pool.layers[0]
    q = torch.randn(rows, layer.num_heads, layer.head_dim).to(torch.bfloat16)  # (R, H, D)
    call = lambda: extend_attention(q, k, v, meta.cu_seqlens_q, meta.prefix_lens,  # noqa: E731
                                    meta.page_table, meta.max_query_len)  # fmt: skip
    call()
    ms = median_ms(call, 20)
    return rows * context * layer.num_heads * layer.head_dim * 4 / ms / 1e6


def layer_params(engine: Engine) -> int:
    return sum(
        p.in_features * p.out_features
        for layer in engine.model.decoder_layers
        for p in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
    )


def measure(
    engine: Engine, fused: FusedDecode, pages: list[int], rows: int, repeats: int
) -> dict[str, float]:
    model, c = engine.model, engine.config
    delta = torch.randint(3, c.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    chunk = SequenceChunk(delta.tolist(), PREFIX_TOKENS, pages, True)
    fb = build_forward_batch([chunk], engine.page_size, engine.device)
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
    context = PREFIX_TOKENS + (rows + 1) / 2  # the mean keys a row reads
    gemm_rate = gemm_gflops(engine, rows)
    attn_rate = attention_gflops(engine, fb, context)
    gemm_flops = 2 * rows * layer_params(engine) + 2 * c.vocab_size * c.hidden_size
    layer = model.decoder_layers[0]
    attn_flops = rows * context * layer.num_heads * layer.head_dim * 4 * c.num_layers
    floor = gemm_flops / gemm_rate / 1e6 + attn_flops / attn_rate / 1e6
    return {"rows": rows, "torch ms": statistics.median(times["torch"]),
            "native ms": statistics.median(times["native"]),
            "torch min ms": min(times["torch"]), "native min ms": min(times["native"]),
            "gemm GFLOP/s": gemm_rate,
            "attention GFLOP/s": attn_rate, "gemm GFLOP": gemm_flops / 1e9,
            "attention GFLOP": attn_flops / 1e9, "floor ms": floor}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rows", type=int, nargs="+", default=list(ROWS))
    parser.add_argument("--max-rows", type=int, default=None,
                        help="a native step with buffers for this many rows (default: the "
                        "engine's)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results/extend-ab.json"))
    args = parser.parse_args()
    engine = Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.25, prefix_cache=False))  # fmt: skip
    fused = engine.runner.fused
    assert fused is not None, "the default model takes the native step"
    if args.max_rows is not None:
        fused = fused_decode_for(engine.model, engine.kv_pool.layers, fused.max_batch,
                                 fused.step.threads, max_rows=args.max_rows)  # fmt: skip
        assert fused is not None
    ps = engine.page_size
    pages = engine.allocator.alloc(-(-(PREFIX_TOKENS + max(args.rows)) // ps))
    prefix = torch.randint(3, engine.config.vocab_size, (PREFIX_TOKENS,),
                           generator=torch.Generator().manual_seed(0))  # fmt: skip
    rows = []
    with torch.inference_mode():
        fb = build_forward_batch([SequenceChunk(prefix.tolist(), 0, pages, True)], ps,
                                 engine.device)  # fmt: skip
        engine.model(fb.input_ids, fb.positions, engine.kv_pool.layers, fb.attn,
                     fb.logits_indices)  # the cached prefix  # fmt: skip
        for r in args.rows:
            rows.append(measure(engine, fused, pages, r, args.repeats))
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
