"""Quantized weights against the compute dtype, one run: memory, load, decode, TTFT.

Each quantization (``none`` and the quantized path, ``auto`` by default) is measured in
a fresh process (`probe`), so that resident memory is its own: RSS before the model
loads, the peak during the load (``ru_maxrss``) and after it, the weights' bytes against
the GGUF's tensor bytes, then on the loaded engine: decode tokens/s and the step time
(ITL) at batch 1, 4 and 16, an uncached 512-token prefill, and a cached turn's TTFT (a
1,024-token context seen before plus a 16-token question). `radixserve bench --scenario
engine` prints this table after its own.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from radixserve.settings import EngineSettings

_BATCHES = (1, 4, 16)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _gguf_tensor_bytes(path: Path) -> int | None:
    if path.suffix.lower() != ".gguf":
        return None
    from gguf import GGUFReader

    return sum(int(t.n_bytes) for t in GGUFReader(path).tensors)


def probe(settings: EngineSettings, quick: bool) -> dict:
    """Load one engine in this process and measure it (see the module docstring)."""
    from radixserve.bench.synthetic import synthetic_tokens
    from radixserve.engine.engine import Engine
    from radixserve.engine.sampling_params import SamplingParams
    from radixserve.model.model_files import resolve_model_path

    before = _rss_bytes()
    t0 = time.perf_counter()
    engine = Engine(settings)
    load_s = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    after = _rss_bytes()
    tokens = 16 if quick else 48
    decode = {}
    for b in _BATCHES:
        prompts = [synthetic_tokens(engine, 24, seed=50 + i) for i in range(b)]
        params = SamplingParams(max_tokens=tokens + 1, temperature=0.0, ignore_eos=True)
        engine.generate(prompts, SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        t = time.perf_counter()
        out = engine.generate(prompts, params)
        wall = time.perf_counter() - t
        itl = statistics.mean((r.e2e_ms - r.ttft_ms) / tokens for r in out)
        decode[str(b)] = {"tok_s": b * tokens / wall, "itl_ms": itl}
    greedy = SamplingParams(max_tokens=1, temperature=0.0)
    prompts = [synthetic_tokens(engine, 512, seed=3 + 1000 * i) for i in range(3)]  # unseen
    prefill_ms = min(engine.generate([p], greedy)[0].ttft_ms for p in prompts)
    context = synthetic_tokens(engine, 1024, seed=4)
    engine.generate([context + synthetic_tokens(engine, 16, seed=5)], greedy)
    cached = [engine.generate([context + synthetic_tokens(engine, 16, seed=6 + i)], greedy)[0]
              for i in range(3)]  # fmt: skip
    return {
        "quantization": settings.quantization,
        "weights": engine.quantization,
        "weight_bytes": engine.model.weight_bytes,
        "gguf_tensor_bytes": _gguf_tensor_bytes(resolve_model_path(settings.model)),
        "rss_before_load": before,
        "rss_peak": peak,
        "rss_after_load": after,
        "load_s": load_s,
        "decode": decode,
        "prefill_512_ms": prefill_ms,
        "cached_turn_ttft_ms": statistics.median(r.ttft_ms for r in cached),
        "cached_tokens": cached[-1].cached_tokens,
    }


def run_quant_ab(settings: EngineSettings, quick: bool, schemes: tuple[str, ...]) -> list[dict]:
    """`probe` each quantization in its own process; their results in order."""
    results = []
    for scheme in schemes:
        print(f"  quantization={scheme}: load and measure in a fresh process ...", file=sys.stderr)
        s = settings.model_copy(
            update={"quantization": scheme, "kv_cache_memory_gib": 0.1, "load_progress": False}
        )
        argv = [sys.executable, "-m", "radixserve.bench.quant_ab", s.model_dump_json()]
        proc = subprocess.run(argv + (["--quick"] if quick else []), capture_output=True,
                              text=True, check=False)  # fmt: skip
        if proc.returncode != 0:
            raise RuntimeError(f"probe of quantization={scheme} failed:\n{proc.stderr[-2000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return results


def format_quant_table(results: list[dict]) -> str:
    mib = 1 / (1 << 20)
    head = "| quantization | weights | MiB | ×GGUF | peak/after RSS | load s |"
    head += (
        "".join(f" b{b} tok/s (ITL ms) |" for b in _BATCHES) + " prefill 512 ms | cached TTFT ms |"
    )
    lines = ["", "weights: compute dtype vs quantized (each in a fresh process)", "", head,
             "|" + "---|" * (8 + len(_BATCHES))]  # fmt: skip
    for r in results:
        ratio = r["weight_bytes"] / r["gguf_tensor_bytes"] if r["gguf_tensor_bytes"] else None
        cells = [r["quantization"], r["weights"], f"{r['weight_bytes'] * mib:.1f}",
                 f"{ratio:.2f}" if ratio else "n/a", f"{r['rss_peak'] / r['rss_after_load']:.2f}",
                 f"{r['load_s']:.1f}"]  # fmt: skip
        cells += [f"{d['tok_s']:.0f} ({d['itl_ms']:.1f})" for d in r["decode"].values()]
        cells += [f"{r['prefill_512_ms']:.0f}", f"{r['cached_turn_ttft_ms']:.0f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if len(results) == 2:
        a, b = results
        lines.append("")
        lines.append(
            f"{b['quantization']}/{a['quantization']}: weights {b['weight_bytes'] / a['weight_bytes']:.2f}×, "
            + ", ".join(
                f"b{k} tok/s {b['decode'][k]['tok_s'] / a['decode'][k]['tok_s']:.2f}×"
                for k in a["decode"]
            )
            + f", prefill {b['prefill_512_ms'] / a['prefill_512_ms']:.2f}× the time, cached TTFT "
            f"{b['cached_turn_ttft_ms'] / a['cached_turn_ttft_ms']:.2f}×"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description="measure one engine (run by run_quant_ab)")
    parser.add_argument("settings", help="EngineSettings as JSON")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    settings = EngineSettings.model_validate_json(args.settings)
    print(json.dumps(probe(settings, args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
