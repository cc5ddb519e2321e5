"""`radixserve bench --scenario sampling`: what log-probabilities and structured output
cost in decoding.

One engine, a batch of 16 requests (distinct prompts), decode tokens/s measured after
every request has its first token, for three kinds of request run in turn (repeats
interleaved, medians reported): plain sampling, plain + ``logprobs: 5``, and a JSON
schema (a fixed-length array of digits, so the output is as long as the plain one).
The ratios to plain decoding at the same batch are the figures, with the time per step
spent outside the model forward (what the extra work adds, less sensitive to a busy
machine than tokens/s); one table, `--out` writes JSON.
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

BATCH = 16


def _params(kind: str, tokens: int) -> SamplingParams:
    common: dict[str, Any] = dict(max_tokens=tokens, temperature=0.7, seed=1, ignore_eos=True)
    if kind == "plain":
        return SamplingParams(**common, min_tokens=tokens)
    if kind == "logprobs5":
        return SamplingParams(**common, min_tokens=tokens, logprobs=5)
    digits = tokens // 2  # "[", then a digit and a comma per item: about 2 tokens each
    schema = {"type": "array", "minItems": digits, "maxItems": digits,
              "items": {"type": "integer", "minimum": 0, "maximum": 9}}  # fmt: skip
    return SamplingParams(**common, guide_kind="json_schema", guide=json.dumps(schema))


class _TimedRunner:
    """Wraps the engine's model runner to add up the time of the forward passes."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.seconds = 0.0

    def run(self, batch: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return self.runner.run(batch)
        finally:
            self.seconds += time.perf_counter() - t0


def decode_tok_s(engine: Engine, prompts: list[list[int]], params: SamplingParams):
    """(tokens/s, ms per step outside the model forward) over the decode steps of one
    batch, after every request has its first token."""
    rids = [engine.add_request(p, params) for p in prompts]
    started: set[str] = set()
    while len(started) < len(rids):
        started.update(o.request_id for o in engine.step() if o.new_token_ids)
    timed = _TimedRunner(engine.runner)
    engine.runner = timed  # type: ignore[assignment]
    tokens, steps, t0 = 0, 0, time.perf_counter()
    try:
        while engine.has_unfinished():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
            steps += 1
    finally:
        engine.runner = timed.runner
    elapsed = time.perf_counter() - t0
    return tokens / elapsed, (elapsed - timed.seconds) * 1000.0 / max(steps, 1)


def run_sampling_bench(settings: EngineSettings, out_path: str | None, quick: bool = False):
    tokens, repeats = (16, 4) if quick else (64, 5)
    print(f"loading {settings.model} ...", file=sys.stderr)
    engine = Engine(settings)
    prompts = [
        engine.tokenizer.encode_chat([{"role": "user", "content": f"Tell me fact number {i}."}])
        for i in range(BATCH)
    ]
    kinds = ("plain", "logprobs5", "json_schema")
    decode_tok_s(engine, prompts, _params("json_schema", 8))  # warm-up (grammar tables too)
    runs: dict[str, list[float]] = {k: [] for k in kinds}
    outside: dict[str, list[float]] = {k: [] for k in kinds}
    for r in range(repeats):
        for kind in kinds:
            print(f"  {kind} run {r + 1}/{repeats} ...", file=sys.stderr)
            tok_s, extra_ms = decode_tok_s(engine, prompts, _params(kind, tokens))
            runs[kind].append(tok_s)
            outside[kind].append(extra_ms)
    medians = {k: statistics.median(v) for k, v in runs.items()}
    result = {
        "scenario": "sampling",
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "model": engine.config.name,
        "device": str(engine.device),
        "dtype": str(engine.dtype),
        "batch": BATCH,
        "decode_tokens": tokens,
        "repeats": repeats,
        "decode_tok_s": medians,
        "runs_tok_s": runs,
        # per decode step, the time outside the model forward: scheduling, sampling,
        # masks not hidden behind the forward, log-probabilities, detokenising
        "outside_forward_ms_per_step": {k: statistics.median(v) for k, v in outside.items()},
        "ratio_to_plain": {k: medians[k] / medians["plain"] for k in kinds},
    }
    print(format_table(result))
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0


def format_table(r: dict[str, Any]) -> str:
    lines = [
        f"sampling benchmark — {r['model']} on {r['device']}/{r['dtype']}, batch {r['batch']}, "
        f"{r['decode_tokens']} decode tokens, median of {r['repeats']}",
        "| request | decode tok/s | vs plain | ms/step outside the forward |",
        "|---|---|---|---|",
    ]
    for kind, tok_s in r["decode_tok_s"].items():
        extra = r["outside_forward_ms_per_step"][kind]
        lines.append(f"| {kind} | {tok_s:.1f} | {r['ratio_to_plain'][kind]:.3f} | {extra:.1f} |")
    return "\n".join(lines)
