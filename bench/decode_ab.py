"""Decode ITL with the layers in one native call against the layers' torch ops, in one run.

Two engines on the default model and settings, one with ``fused_decode`` (the default)
and one without it; the native step is timed on 1 and on 2 threads. For each batch size
(1, 4, 16) the variants take turns, A B C A B C, a few times after a warm-up, each
timing `STEPS` engine steps of every sequence decoding (whole `Engine.step` calls: the
forward, sampling, detokenizing and the loop), medians. Beside them, the memory floor of
a step: the bytes it must read (every weight matrix, the tied LM head included, and the
KV of every sequence's context) over the copy bandwidth measured in the same run.

    .venv/bin/python bench/decode_ab.py [--repeats 3] [--out bench/results/decode-ab.json]

Prints one table (ms per step, the ratios) and writes the rows as JSON. Another
process on the machine moves single figures; the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from radixserve.bench.memory_floor import copy_gbs, kv_bytes_per_token
from radixserve.bench.memory_floor import floor_ms as read_ms
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.model.fused_decode import FusedDecode, fused_decode_for
from radixserve.settings import EngineSettings

BATCHES = (1, 4, 16)
STEPS = 16
PROMPT_TOKENS = 256


def make(fused: bool) -> Engine:
    return Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                                 kv_cache_memory_gib=0.5, prefix_cache=False,
                                 fused_decode=fused))  # fmt: skip


def step_ms(engine: Engine, batch: int, threads: int | None, tag: str) -> tuple[float, int]:
    """Median ms of a decode step of `batch` sequences (and their mean context)."""
    fused = engine.runner.fused
    if fused is not None and threads is not None:
        engine.runner.fused = _native(engine, threads)
    return median_step_ms(engine, [""] * batch, tag, PROMPT_TOKENS, STEPS)


def median_step_ms(
    engine: Engine, adapters: list[str], tag: str, prompt_tokens: int, steps: int
) -> tuple[float, int]:
    """Median ms of ``steps`` decode steps of one greedy request per entry of
    ``adapters`` (its LoRA adapter, "" for the base model) over a ``prompt_tokens``
    prompt made distinct by ``tag``, after their prefills; and their mean context."""
    tok = engine.tokenizer
    base = tok.encode("The harbour master kept a log of every ship. " * 40)[:prompt_tokens]
    params = SamplingParams(max_tokens=steps + 4, min_tokens=steps + 4, temperature=0.0)
    for i, adapter in enumerate(adapters):
        engine.add_request([*base, *tok.encode(f" {tag} {i}")], params, adapter=adapter)
    running = engine.scheduler.running
    while len(running) < len(adapters) or not all(r.output_ids for r in running):
        engine.step()  # prefills
    engine.step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    context = statistics.mean(r.num_tokens for r in engine.scheduler.running)
    while engine.has_unfinished():
        engine.step()
    return statistics.median(times) * 1e3, int(context)


@functools.cache
def _native(engine: Engine, threads: int) -> FusedDecode:
    """The engine's native step on `threads` threads (each built once)."""
    fused = fused_decode_for(engine.model, engine.kv_pool.layers, max(BATCHES), threads,
                             adaptive=False)  # every batch on `threads`  # fmt: skip
    assert fused is not None
    return fused


def floor_ms(engine: Engine, batch: int, context: int, gbs: float) -> float:
    c = engine.config
    kv = batch * context * kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 2)  # bf16
    return read_ms(engine.model.weight_bytes, kv, gbs)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode-ab.json"))
    args = parser.parse_args()
    engines = {True: make(True), False: make(False)}
    assert engines[True].runner.fused is not None, "the default model takes the native step"
    variants = {"torch ops": (False, None), "native, 1 thread": (True, 1),
                "native, 2 threads": (True, 2)}  # fmt: skip
    gbs = copy_gbs()
    rows = []
    for batch in BATCHES:
        times: dict[str, list[float]] = {name: [] for name in variants}
        context = 0
        for rep in range(args.repeats + 1):  # the first round warms up
            for name, (fused, threads) in variants.items():
                ms, context = step_ms(engines[fused], batch, threads, f"{rep}{name}")
                if rep:
                    times[name].append(ms)
        med = {name: statistics.median(t) for name, t in times.items()}
        rows.append({"batch": batch, "context": context, "copy_gbs": gbs,
                     "floor_ms": floor_ms(engines[True], batch, context, gbs),
                     **{f"{name} ms": m for name, m in med.items()}})  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(
        f"copy bandwidth {gbs:.1f} GB/s (read + write); weights "
        f"{engines[True].model.weight_bytes / 1e6:.1f} MB; torch threads "
        f"{torch.get_num_threads()}"
    )
    print(
        "| batch | context | torch ops ms | native 1 thread ms | native 2 threads ms | "
        "1 thread / torch | 2 threads / torch | floor ms |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        t, n1, n2 = r["torch ops ms"], r["native, 1 thread ms"], r["native, 2 threads ms"]
        print(
            f"| {r['batch']} | {r['context']} | {t:.2f} | {n1:.2f} | {n2:.2f} | "
            f"{n1 / t:.2f}x | {n2 / t:.2f}x | {r['floor_ms']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
