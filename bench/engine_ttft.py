"""`radixserve bench --scenario engine`: TTFT with the prefix cache off and on, one run.

For shared contexts of 1k, 2k and 4k tokens followed by a 16-token question:
  off: a fresh computation of context + question (engine with the cache disabled);
  on:  the context was seen once before (with another question), so only the new
       question is computed.
Also, side by side: uncached prefill tokens/s of this engine vs Hugging Face
transformers (fp32, same weights), match_prefix time for an 8k-token prompt, and the
KV pool's bytes against its budget; then weights in the compute dtype against the
quantized path (`radixserve.bench.quant_ab`). Prints the tables; `--out` writes JSON.
"""

from __future__ import annotations

import json
import logging
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from radixserve.bench.synthetic import synthetic_tokens
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

logger = logging.getLogger(__name__)


def _ttft_ms(engine: Engine, prompt: list[int]) -> tuple[float, int]:
    [result] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    return result.ttft_ms, result.cached_tokens


def measure_context(
    on: Engine, off: Engine, context_len: int, question_len: int, repeats: int
) -> dict:
    context = synthetic_tokens(on, context_len, seed=context_len)
    questions = [synthetic_tokens(on, question_len, seed=1000 + i) for i in range(repeats + 1)]
    off_ms = [_ttft_ms(off, context + q)[0] for q in questions[1:]]
    _ttft_ms(on, context + questions[0])  # the first sighting fills the cache
    on_runs = [_ttft_ms(on, context + q) for q in questions[1:]]
    on_ms = [ms for ms, _ in on_runs]
    off_med, on_med = statistics.median(off_ms), statistics.median(on_ms)
    prompt_len = context_len + question_len
    return {
        "context_tokens": context_len,
        "prompt_tokens": prompt_len,
        "ttft_off_ms": off_med,
        "ttft_on_ms": on_med,
        "cached_tokens": on_runs[-1][1],
        "on_over_off_pct": 100.0 * on_med / off_med,
        "speedup": off_med / on_med,
        "prefill_tok_s_off": prompt_len / (off_med / 1000.0),
    }


def hf_prefill_tok_s(model_path: Path, prompt: list[int], repeats: int) -> float | None:
    """Hugging Face transformers' prefill rate (fp32) on the same weights, if installed."""
    try:
        from transformers import AutoModelForCausalLM
    except ImportError:
        logger.warning("transformers not installed: skipping the Hugging Face comparison")
        return None
    kwargs = {"dtype": torch.float32}
    if model_path.suffix == ".gguf":
        kwargs["gguf_file"] = model_path.name
        model_path = model_path.parent
    model = AutoModelForCausalLM.from_pretrained(str(model_path), **kwargs).eval()
    ids = torch.tensor([prompt])
    times = []
    with torch.inference_mode():
        model(ids[:, :64])  # warm-up
        for _ in range(repeats):
            t0 = time.perf_counter()
            model(ids, logits_to_keep=1)
            times.append(time.perf_counter() - t0)
    del model
    return len(prompt) / statistics.median(times)


def run_engine_bench(settings: EngineSettings, out_path: str | None, quick: bool = False) -> int:
    from radixserve.bench.radix_match import time_match_prefix
    from radixserve.model.model_files import resolve_model_path

    contexts = (256, 512) if quick else (1024, 2048, 4096)
    question_len, repeats = 16, (1 if quick else 3)
    print(f"loading {settings.model} (cache on and off) ...", file=sys.stderr)
    on = Engine(settings.model_copy(update={"prefix_cache": True}))
    off = Engine(settings.model_copy(update={"prefix_cache": False, "load_progress": False}))
    _ttft_ms(off, synthetic_tokens(off, 64, seed=7))  # warm-up of kernels and allocator
    _ttft_ms(on, synthetic_tokens(on, 64, seed=8))
    rows = []
    for n in contexts:
        print(f"  context {n} tokens ...", file=sys.stderr)
        rows.append(measure_context(on, off, n, question_len, repeats))

    prefill_prompt = synthetic_tokens(on, 512 if quick else 2048, seed=99)
    ours_ms = statistics.median(_ttft_ms(off, prefill_prompt)[0] for _ in range(repeats))
    ours_tok_s = len(prefill_prompt) / (ours_ms / 1000.0)
    print("  Hugging Face transformers prefill (fp32) ...", file=sys.stderr)
    hf_tok_s = hf_prefill_tok_s(resolve_model_path(settings.model), prefill_prompt, repeats)
    match = time_match_prefix(num_tokens=8192, page_size=settings.page_size)
    budget = int(settings.kv_cache_memory_gib * (1 << 30))
    result = {
        "scenario": "engine",
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor(),
            "threads": torch.get_num_threads(),
        },  # fmt: skip
        "model": on.config.name,
        "settings": {
            "dtype": str(on.dtype),
            "device": str(on.device),
            "page_size": on.page_size,
            "chunk_tokens": settings.max_num_batched_tokens,
        },  # fmt: skip
        "contexts": rows,
        "prefill": {
            "prompt_tokens": len(prefill_prompt),
            "ours_tok_s": ours_tok_s,
            "hf_transformers_fp32_tok_s": hf_tok_s,
            "ratio": ours_tok_s / hf_tok_s if hf_tok_s else None,
        },
        "match_prefix_8k_us": match,
        "kv_pool": {
            "bytes": on.kv_pool.size_bytes,
            "budget_bytes": budget,
            "within_budget": on.kv_pool.size_bytes <= budget,
        },  # fmt: skip
    }
    from radixserve.bench.quant_ab import format_quant_table, run_quant_ab

    quantized = settings.quantization if settings.quantization != "none" else "auto"
    result["quantization"] = run_quant_ab(settings, quick, ("none", quantized))
    print(format_table(result))
    print(format_quant_table(result["quantization"]))
    if out_path:
        Path(out_path).write_text(json.dumps(result, indent=2))
        print(f"wrote {out_path}", file=sys.stderr)
    return 0


def format_table(r: dict) -> str:
    lines = [
        f"engine benchmark — {r['model']} on {r['settings']['device']}/{r['settings']['dtype']}",
        "",
        "| context | prompt | TTFT off (ms) | TTFT on (ms) | cached | on/off | speedup |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in r["contexts"]:
        lines.append(
            f"| {c['context_tokens']} | {c['prompt_tokens']} | {c['ttft_off_ms']:.1f} | "
            f"{c['ttft_on_ms']:.1f} | {c['cached_tokens']} | {c['on_over_off_pct']:.2f} % | "
            f"{c['speedup']:.1f}× |"
        )
    p = r["prefill"]
    hf = f"{p['hf_transformers_fp32_tok_s']:.0f}" if p["hf_transformers_fp32_tok_s"] else "n/a"
    ratio = f"{p['ratio']:.2f}×" if p["ratio"] else "n/a"
    m, kv = r["match_prefix_8k_us"], r["kv_pool"]
    lines += [
        "",
        f"uncached prefill, {p['prompt_tokens']} tokens: {p['ours_tok_s']:.0f} tok/s vs "
        f"transformers fp32 {hf} tok/s → {ratio} (target ≥ 2×)",
        f"match_prefix, 8k-token prompt: median {m['median_us']:.1f} µs (target < 200 µs)",
        f"KV pool: {kv['bytes'] / 2**20:.1f} MiB of a {kv['budget_bytes'] / 2**20:.1f} MiB budget "
        f"({'within' if kv['within_budget'] else 'OVER'} budget)",
    ]
    return "\n".join(lines)
