"""`radixserve bench --scenario lora`: serving LoRA adapters beside the base model.

One in-process engine (the model's, the engine's defaults on the CPU, ``max_loras`` as
many slots as the most adapters a batch names, so nothing swaps while decode is timed)
serves seeded random rank-16 adapters on all seven projections (`bench/lora_adapters.py`),
written in PEFT's layout to a temporary folder and loaded with `Engine.load_lora`.
In one run:

1. **Decode throughput**: a batch of B requests (greedy, ``ignore_eos`` and
   ``min_tokens`` so each decodes T tokens) with 0 adapters (the base model), 1, 4 and
   16 distinct adapters (request i names adapter i mod k); the variants take turns per
   repeat (the order reversed every other repeat) so the machine's drift falls on all.
   Decode tokens/s, ITL, the ratio to the base model's, and how many steps the native
   decode step computed.
2. **Swap-in** (`lora_chat.measure_swaps`): `load_lora` of a fresh adapter (disk →
   host), and the first step of a request whose adapter is not resident (its first use,
   or back after its eviction: every slot is held) against one whose adapter is and one
   of the base model.
3. **The adapters change the answers** (`lora_chat.measure_divergence`): one open
   prompt, the base model and the chats' adapters; where each answer departs.
4. **Cached turns** (`lora_chat.measure_chat`): a 3-turn chat per adapter and the base
   model, each on its own notes; each turn's TTFT and cached tokens, and a cross-check
   that another adapter (and the base model) given an adapter's prompt finds nothing
   cached while the adapter itself finds it.

Writes JSON, prints a table, plots tokens/s against adapters beside the JSON
(`lora_report`); exits 1 when a check fails (`lora_report.problems`).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from radixserve.bench.lora_adapters import MODULES
from radixserve.bench.lora_engine import (
    EngineFactory,
    LoraOptions,
    NativeSteps,
    adapter_names,
    default_factory,
    make_adapters,
    progress,
    run_batch,
)
from radixserve.bench.speculative import environment
from radixserve.bench.synthetic import synthetic_ids
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams


def throughput_jobs(engine: Engine, options: LoraOptions, count: int,
                    seed: int) -> list[tuple[list[int], str]]:  # fmt: skip
    """B distinct prompts, request i on adapter i mod ``count`` (the base model for 0)."""
    names = adapter_names(count)
    return [(synthetic_ids(engine.tokenizer, options.prompt_tokens, seed * 1000 + i),
             names[i % count] if count else "") for i in range(options.batch)]  # fmt: skip


def measure_throughput(engine: Engine, options: LoraOptions) -> dict[str, Any]:
    """Every adapter count's batch, ``options.repeats`` times, alternating: the runs."""
    params = SamplingParams(max_tokens=options.decode_tokens, min_tokens=options.decode_tokens,
                            temperature=0.0, ignore_eos=True)  # fmt: skip
    warm = SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0, ignore_eos=True)
    for count in options.adapter_counts:  # unmeasured: each path's first use, every slot filled
        run_batch(engine, throughput_jobs(engine, options, count, -1 - count), warm)
    runs: dict[int, list[dict[str, Any]]] = {c: [] for c in options.adapter_counts}
    order_log = []
    for repeat in range(options.repeats):
        order = list(options.adapter_counts)
        if repeat % 2:
            order.reverse()
        order_log.append(order)
        for count in order:
            progress(f"decode: {count} adapter(s), repeat {repeat + 1}/{options.repeats}")
            seed = (options.seed * 1000 + repeat) * 1000 + count  # distinct per cell and repeat
            jobs = throughput_jobs(engine, options, count, seed)
            with NativeSteps(engine) as native:
                streams, steps = run_batch(engine, jobs, params)
            runs[count].append({"streams": streams, "steps": steps, "native_steps": native.count})
    return {"runs": runs, "order": order_log}


def run_lora(options: LoraOptions, make_engine: EngineFactory | None = None) -> dict[str, Any]:
    """The whole scenario: the report (`lora_report.write_report` writes it)."""
    from radixserve.bench.lora_chat import measure_chat, measure_divergence, measure_swaps
    from radixserve.bench.lora_report import throughput_figures

    started = time.perf_counter()
    options_doc = {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()}
    report: dict[str, Any] = {"scenario": "lora", "options": options_doc,
                              "environment": environment()}  # fmt: skip
    progress(f"loading the engine (max_loras={options.max_loras})")
    engine = (make_engine or default_factory(options))(options.max_loras)
    fused = engine.runner.fused is not None
    report["engine"] = {"model": engine.config.name, "dtype": str(engine.dtype),
                        "device": str(engine.device), "max_loras": engine.loras.max_loras,
                        "max_lora_rank": engine.loras.max_rank, "native_decode_step": fused}  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="radixserve-lora-") as folder:
        # the largest batch's adapters, at least the chats' and two (the cross-check)
        names = adapter_names(max(*options.adapter_counts, options.chat_adapters, 2))
        make_adapters(engine, Path(folder), names, options, options.seed * 1000)
        sizes = {engine.loras.adapter(n).size_bytes for n in names}
        report["adapters"] = {"count": len(names), "rank": options.rank,
                              "targets": list(MODULES), "strength": options.strength,
                              "size_bytes": max(sizes, default=0), "folder": "a temporary folder"}  # fmt: skip
        throughput = measure_throughput(engine, options)
        report["throughput"] = throughput_figures(throughput["runs"], options.decode_tokens,
                                                  options.batch, throughput["order"])  # fmt: skip
        report["divergence"] = measure_divergence(engine, names[: options.chat_adapters],
                                                  options.chat_answer_tokens)  # fmt: skip
        progress("cached turns per adapter")
        report["chat"] = measure_chat(engine, options, names[: options.chat_adapters])
        progress("swap-in")
        report["swap"] = measure_swaps(engine, options, Path(folder), names)
    report["environment"]["load_average_end"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - started
    return report


def run_lora_bench(options: LoraOptions, make_engine: EngineFactory | None = None) -> int:
    """`radixserve bench --scenario lora`: run, write, print; 1 when a check fails."""
    from radixserve.bench.lora_report import write_report

    report = run_lora(options, make_engine)
    write_report(report, options.out_path)
    if report["problems"]:
        for problem in report["problems"]:
            print(f"ERROR: {problem}", file=sys.stderr)
        return 1
    return 0
