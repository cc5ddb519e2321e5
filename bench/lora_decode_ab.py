"""Decode throughput with LoRA adapters against the base model, in one run.

One engine on the default model and settings, with 4 random rank-16 adapters on all
seven projections (`bench/lora_adapters.py`) loaded. For a batch of 16 requests the
variants take turns, A B C C B A A B C ..., a few times after a warm-up, each timing
`STEPS` engine steps of every sequence decoding (whole `Engine.step` calls), medians:

- ``base``: 16 requests of the base model (the native decode step);
- ``lora``: 16 requests over the 4 adapters, 4 each, interleaved (the native decode
  step with the adapters' updates);
- ``lora, torch layers``: the same through the layers' torch ops (the native step off).

    .venv/bin/python bench/lora_decode_ab.py [--repeats 3] [--out bench/results/lora-decode-ab.json]

Prints one table (ms per step, tokens/s and each against the base model's: the median of
the repeats' own ratios, each repeat's variants timed back to back, and the ratio of the
fastest repeats) and writes the rows as JSON. Another process on the machine moves single
figures; the ratios within one run are what count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from radixserve.bench.decode_ab import median_step_ms
from radixserve.bench.lora_adapters import write_adapter
from radixserve.engine.engine import Engine
from radixserve.model.model_files import open_model
from radixserve.settings import EngineSettings

BATCH = 16
ADAPTERS = 4
RANK = 16
STEPS = 16
PROMPT_TOKENS = 128


def make(adapter_dirs: list[Path]) -> Engine:
    modules = tuple(f"a{i}={path}" for i, path in enumerate(adapter_dirs))
    return Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                                 kv_cache_memory_gib=0.5, prefix_cache=False,
                                 lora_modules=modules, max_loras=ADAPTERS))  # fmt: skip


def step_ms(engine: Engine, adapters: list[str], fused: bool, tag: str) -> float:
    """Median ms of a decode step of one request per entry of ``adapters``."""
    native = engine.runner.fused
    if not fused:
        engine.runner.fused = None
    ms, _ = median_step_ms(engine, adapters, tag, PROMPT_TOKENS, STEPS)
    engine.runner.fused = native
    return ms


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path("bench/results/lora-decode-ab.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        config = open_model("default").config
        dirs = [write_adapter(Path(tmp) / f"a{i}", config, RANK, seed=i) for i in range(ADAPTERS)]
        engine = make(dirs)
        assert engine.runner.fused is not None, "the default model takes the native step"
        names = [f"a{i % ADAPTERS}" for i in range(BATCH)]
        variants = {"base": ([""] * BATCH, True), "lora": (names, True),
                    "lora, torch layers": (names, False)}  # fmt: skip
        times: dict[str, list[float]] = {name: [] for name in variants}
        load = os.getloadavg()[0]
        for rep in range(args.repeats + 1):  # the first round warms up
            order = list(variants.items())
            for name, (adapters, fused) in order if rep % 2 else order[::-1]:
                ms = step_ms(engine, adapters, fused, f"{rep}{name}")
                if rep:
                    times[name].append(ms)
    med = {name: statistics.median(t) for name, t in times.items()}
    rows = [{"variant": name, "batch": BATCH, "adapters": ADAPTERS, "rank": RANK, "ms": ms,
             "tokens_per_s": BATCH * 1e3 / ms,
             "vs_base": statistics.median(b / t for b, t in zip(times["base"], times[name])),
             "fastest_vs_base": min(times["base"]) / min(times[name]),
             "runs_ms": times[name]} for name, ms in med.items()]  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))
    print(f"batch {BATCH}, {ADAPTERS} adapters of rank {RANK} on all seven projections; torch "
          f"threads {torch.get_num_threads()}; load average {load:.2f} at the start, "
          f"{os.getloadavg()[0]:.2f} at the end")  # fmt: skip
    print("| variant | ms per step | tokens/s | tokens/s vs base (repeats' median) | fastest vs "
          "fastest base |")  # fmt: skip
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['variant']} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | "
              f"{r['vs_base']:.2f}x | {r['fastest_vs_base']:.2f}x |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
