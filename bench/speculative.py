"""`radixserve bench --scenario speculative`: speculative decoding's drafting methods
(off, prompt, radix, both) on workloads that repeat text and one that does not.

For each workload (`speculative_workloads`) and batch size (1: one request at a time;
16: sixteen at once), in one run, one in-process engine per method runs the same
prompts greedily; the methods take turns per repeat (the order reversed every repeat)
so a change in the machine's load falls on all alike, after a warm-up. Each run of a
method starts with its draft index empty (it then holds that run's primes and answers
only), and each repeat has its own prompts (seeded). Per cell: decode tokens/s, ITL (mean, p50), acceptance (accepted / drafted),
tokens per verification step, the ratios to off, and whether every answer is the one
`off` gave (greedy decoding with speculation must give the same tokens: a difference is
an error, printed and recorded). With ``through_cluster``, batch-1 code-edit and RAG go
through `radixserve up` too (off vs both), ITL from the stream, acceptance from the
gateway's /metrics. Writes JSON, prints a table, plots beside the JSON.
"""

from __future__ import annotations

import datetime
import os
import platform
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from radixserve.bench.speculative_options import Answer, SpeculativeOptions
from radixserve.bench.speculative_report import cell_figures, write_report
from radixserve.bench.speculative_workloads import Conversation, build_workload
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.engine.speculation import SpeculativeMethod
from radixserve.settings import EngineSettings


def progress(message: str) -> None:
    print(f"[speculative {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


#: builds the engine of one drafting method
EngineFactory = Callable[[SpeculativeMethod], Engine]


def default_factory(options: SpeculativeOptions) -> EngineFactory:
    """Engines of ``options.model`` on the CPU with the defaults."""

    def make(method: SpeculativeMethod) -> Engine:
        return Engine(EngineSettings(model=options.model, device="cpu", load_progress=False,
                                     speculative_method=method))  # fmt: skip

    return make


def run_turn(engine: Engine, prompts: Sequence[list[int]], max_tokens: int) -> list[Answer]:
    """Run ``prompts`` as one batch (all queued at once) to the end, greedily."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    ids = [engine.add_request(p, params) for p in prompts]
    answers = {i: Answer([], "", [], []) for i in ids}
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter()
        for out in outputs:
            answer = answers.get(out.request_id)
            if answer is None or not out.new_token_ids:
                continue
            answer.token_ids += out.new_token_ids
            answer.text += out.new_text
            answer.times.append(now)
            answer.sizes.append(len(out.new_token_ids))
    return [answers[i] for i in ids]


def run_conversations(engine: Engine, conversations: Sequence[Conversation], batch: int,
                      max_tokens: int) -> list[list[Answer]]:  # fmt: skip
    """Each conversation's answers, ``batch`` conversations at a time, turn by turn."""
    tokenizer = engine.tokenizer
    result: list[list[Answer]] = []
    for lo in range(0, len(conversations), batch):
        group = conversations[lo : lo + batch]
        answers: list[list[Answer]] = [[] for _ in group]
        for turn in range(max(len(c.turns) for c in group)):
            live = [i for i, c in enumerate(group) if turn < len(c.turns)]
            prompts = [tokenizer.encode_chat(group[i].turns[turn]([a.text for a in answers[i]]))
                       for i in live]  # fmt: skip
            for i, answer in zip(live, run_turn(engine, prompts, max_tokens)):
                answers[i].append(answer)
        result += answers
    return result


def counters(engine: Engine) -> dict[str, int]:
    """The engine's speculation counters summed over its drafting methods."""
    total = {"steps": 0, "drafted": 0, "accepted": 0, "emitted": 0}
    for stats in engine.speculator.stats.values():
        for key in total:
            total[key] += getattr(stats, key)
    return total


def measure(engine: Engine, conversations: Sequence[Conversation],
            primes: Sequence[Conversation], batch: int, max_tokens: int) -> dict[str, Any]:  # fmt: skip
    """One method's run of one cell: its answers and the speculation counters it moved
    (the draft index emptied first, so it holds this run's text only; the primes run
    first, one at a time, unmeasured)."""
    engine.speculator.reset_index()
    run_conversations(engine, primes, 1, max_tokens)
    before = counters(engine)
    answers = run_conversations(engine, conversations, batch, max_tokens)
    after = counters(engine)
    return {"answers": answers, "counters": {k: after[k] - before[k] for k in after}}


def mismatches(reference: list[list[Answer]], other: list[list[Answer]]) -> list[dict[str, Any]]:
    """Where ``other``'s answers differ from ``reference``'s (off's)."""
    found = []
    for c, (ref_turns, turns) in enumerate(zip(reference, other)):
        for t, (ref, got) in enumerate(zip(ref_turns, turns)):
            if ref.token_ids == got.token_ids:
                continue
            at = next((i for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids))
                       if a != b), min(len(ref.token_ids), len(got.token_ids)))  # fmt: skip
            found.append({"conversation": c, "turn": t, "first_different_token": at,
                          "off_text": ref.text[:300], "text": got.text[:300]})  # fmt: skip
    return found


def run_cell(engines: Mapping[str, Engine], workload: str, batch: int, options: SpeculativeOptions,
             report: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """Every method on one (workload, batch), ``options.repeats`` times."""
    count = (
        options.conversations.get(workload, options.batch1_conversations) if batch == 1 else batch
    )
    max_tokens = options.max_tokens.get(workload, options.default_max_tokens)
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in options.methods}
    for repeat in range(options.repeats):
        work = build_workload(workload, options.seed * 1000 + repeat * 10 + batch, count)
        order = list(options.methods) if repeat % 2 == 0 else list(reversed(options.methods))
        for method in order:
            progress(f"{workload} B{batch} repeat {repeat + 1}/{options.repeats}: {method}")
            runs[method].append(measure(engines[method], work.conversations, work.primes,
                                        batch, max_tokens))  # fmt: skip
        reference = runs[options.methods[0]][-1]["answers"]
        for method in options.methods[1:]:
            for bad in mismatches(reference, runs[method][-1]["answers"]):
                bad.update(workload=workload, batch=batch, repeat=repeat, method=method)
                report["mismatches"].append(bad)
                progress(f"!!! MISMATCH: {method} answered differently from "
                         f"{options.methods[0]} ({workload} B{batch} repeat {repeat + 1}, "
                         f"conversation {bad['conversation']} turn {bad['turn']}, from token "
                         f"{bad['first_different_token']}): {bad['text'][:120]!r} vs "
                         f"{bad['off_text'][:120]!r}")  # fmt: skip
    return cell_figures(workload, batch, max_tokens, runs, options.methods[0])


def environment() -> dict[str, Any]:
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "load_average": list(os.getloadavg()),
        "python": platform.python_version(),
    }


def run_speculative(options: SpeculativeOptions,
                    make_engine: EngineFactory | None = None) -> dict[str, Any]:  # fmt: skip
    """The whole grid (and the cluster's cells with ``through_cluster``): the report.
    ``make_engine``: each method's engine (default: `default_factory`)."""
    started = time.perf_counter()
    report: dict[str, Any] = {
        "scenario": "speculative",
        "options": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(options).items()
        },  # fmt: skip
        "environment": environment(),
        "cells": [],
        "mismatches": [],
    }
    progress(f"loading {len(options.methods)} engines ({', '.join(options.methods)})")
    make_engine = make_engine or default_factory(options)
    engines: dict[str, Engine] = {m: make_engine(m) for m in options.methods}
    warm = build_workload("open-chat", -1, 1)
    for engine in engines.values():
        run_conversations(engine, warm.conversations, 1, 16)  # warm-up, unmeasured
    for workload in options.workloads:
        for batch in options.batches:
            report["cells"].append(run_cell(engines, workload, batch, options, report))
    del engines
    if options.through_cluster:
        from radixserve.bench.speculative_cluster import run_cluster_cells

        try:
            report["cluster"] = run_cluster_cells(options, progress)
        except Exception as exc:  # the in-process figures are still worth writing
            progress(f"!!! the cluster's cells failed: {exc!r}")
            report["cluster"] = {"cells": [], "mismatches": [], "error": repr(exc)}
        report["mismatches"] += report["cluster"].pop("mismatches")
    report["environment"]["load_average_end"] = list(os.getloadavg())
    report["wall_s"] = time.perf_counter() - started
    return report


def run_speculative_bench(options: SpeculativeOptions,
                          make_engine: EngineFactory | None = None) -> int:  # fmt: skip
    """`radixserve bench --scenario speculative`: run, write, print; 1 on a mismatch."""
    report = run_speculative(options, make_engine)
    write_report(report, options.out_path)
    if report["mismatches"]:
        print(f"ERROR: {len(report['mismatches'])} answer(s) differ from off's with "
              "speculation on (greedy); see 'mismatches' in the JSON", file=sys.stderr)  # fmt: skip
        return 1
    return 0
