"""float32 vs bfloat16 on this CPU, the figures behind ``dtype=auto``.

One engine per dtype (the default model, prefix cache off), measured in turn A B A B
(three repeats after a warm-up, medians) so a drifting machine hits both: a 512-token
prefill, and the time of one decode step at batch 1, 4 and 16 (20 steps after every
request has two tokens). Prints one table with the ratio bf16 / fp32 (below 1: bfloat16
is faster). Run ``.venv/bin/python bench/dtype_ab.py``.
"""

from __future__ import annotations

import statistics
import time

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

DTYPES = ("float32", "bfloat16")
BATCHES = (1, 4, 16)
STEPS = 20


def make(dtype: str) -> Engine:
    return Engine(EngineSettings(model="default", device="cpu", dtype=dtype,
                                 load_progress=False, kv_cache_memory_gib=0.5,
                                 prefix_cache=False))  # fmt: skip


def measure(engine: Engine, tag: int) -> dict[str, float]:
    tok = engine.tokenizer
    prompt = tok.encode("The library opens at nine. " * 80)[:512]
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=1))
    out = {"prefill 512 tokens, ms": (time.perf_counter() - start) * 1000}
    params = SamplingParams(max_tokens=STEPS + 20, min_tokens=STEPS + 20, temperature=0.0)
    for batch in BATCHES:
        rids = [engine.add_request(tok.encode(f"Story {tag}.{i}: once upon a time"), params)
                for i in range(batch)]  # fmt: skip
        tokens = dict.fromkeys(rids, 0)  # generated so far
        while min(tokens.values()) < 2:
            tokens.update((o.request_id, o.completion_tokens) for o in engine.step())
        start = time.perf_counter()
        for _ in range(STEPS):
            engine.step()
        out[f"decode step, batch {batch}, ms"] = (time.perf_counter() - start) * 1000 / STEPS
        for r in rids:
            engine.abort(r)
    return out


def main() -> None:
    engines = {d: make(d) for d in DTYPES}
    for engine in engines.values():
        measure(engine, 0)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {d: [] for d in DTYPES}
    for rep in range(3):
        for dtype, engine in engines.items():
            runs[dtype].append(measure(engine, rep + 1))
    print("| figure | float32 | bfloat16 | bf16 / fp32 |\n|---|---|---|---|")
    for key in runs["float32"][0]:
        a, b = (statistics.median(r[key] for r in runs[d]) for d in DTYPES)
        print(f"| {key} | {a:.1f} | {b:.1f} | {b / a:.2f} |")


if __name__ == "__main__":
    main()
