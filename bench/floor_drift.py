"""The memory floor's denominator against the step it judges: copy bandwidth and batch-1
decode steps at a ~2k context, taken in turn, round after round, in one process.

The decode scenario's floor (`bench/memory_floor.py`) is the bytes a step reads over the
copy bandwidth measured once in the run. On a shared host that bandwidth moves between
runs minutes apart; this shows whether the step moves with it. Each round measures the
copy bandwidth (best of five 256 MiB copies), then times `--steps` whole `Engine.step`
calls of one greedy sequence (the default model and settings, no prefix cache) and
takes their median; the floor is that round's bytes (weights + the KV of the context)
over that round's bandwidth. The summary gives the ranges and the correlation between
bandwidth and step time: near 0 when the step is not bound by the bytes it reads.

    .venv/bin/python bench/floor_drift.py [--rounds 16] [--steps 24] [--context 1900]
        [--out bench/results/floor-drift.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from radixserve.bench.memory_floor import copy_gbs, floor_ms, kv_bytes_per_token
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings


def rounds(count: int, steps: int, context: int) -> list[dict[str, float]]:
    """One row per round: copy GB/s, the floor, the median step (ms), the mean context."""
    engine = Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.5, prefix_cache=False))  # fmt: skip
    c = engine.config
    per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, 2)  # bfloat16
    tok = engine.tokenizer
    prompt = tok.encode("The harbour master kept a log of every ship. " * (context // 8))
    params = SamplingParams(max_tokens=count * steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_request(prompt[:context], params)
    running = engine.scheduler.running
    while not running or not running[0].output_ids:
        engine.step()  # the prompt
    for _ in range(3):
        engine.step()
    rows = []
    for i in range(count):
        gbs = copy_gbs()
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        tokens = running[0].num_tokens - steps / 2
        floor = floor_ms(engine.model.weight_bytes, tokens * per_token, gbs)
        step = statistics.median(times) * 1e3
        rows.append({"copy_gbs": gbs, "floor_ms": floor, "step_ms": step,
                     "context": tokens, "step_over_floor": step / floor})  # fmt: skip
        print(
            f"round {i + 1:2d}: copy {gbs:5.1f} GB/s  floor {floor:5.2f} ms  step "
            f"{step:5.2f} ms  {step / floor:4.2f}x  (context {tokens:.0f})",
            file=sys.stderr,
        )
    return rows


def summary(rows: list[dict[str, float]]) -> dict[str, float]:
    """Ranges and the bandwidth-step correlation (Pearson's r) over the rounds."""
    gbs = [r["copy_gbs"] for r in rows]
    step = [r["step_ms"] for r in rows]
    ratio = [r["step_over_floor"] for r in rows]
    r = statistics.correlation(gbs, step) if len(rows) > 2 else float("nan")
    return {"copy_gbs_min": min(gbs), "copy_gbs_max": max(gbs), "step_ms_min": min(step),
            "step_ms_max": max(step), "ratio_min": min(ratio), "ratio_max": max(ratio),
            "rounds_within_2x": sum(x <= 2.0 for x in ratio), "rounds": len(rows),
            "correlation_copy_gbs_step_ms": r}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=1900, help="prompt tokens")
    parser.add_argument("--out", type=Path, default=Path("bench/results/floor-drift.json"))
    args = parser.parse_args()
    if args.rounds < 1 or args.steps < 1 or args.context < 16:
        parser.error("--rounds and --steps must be at least 1, --context at least 16")
    rows = rounds(args.rounds, args.steps, args.context)
    total = summary(rows)
    print(f"copy bandwidth {total['copy_gbs_min']:.1f}-{total['copy_gbs_max']:.1f} GB/s, "
          f"step {total['step_ms_min']:.2f}-{total['step_ms_max']:.2f} ms, step / floor "
          f"{total['ratio_min']:.2f}-{total['ratio_max']:.2f}x ({total['rounds_within_2x']} "
          f"of {total['rounds']} rounds within 2x); correlation of bandwidth and step time "
          f"r = {total['correlation_copy_gbs_step_ms']:+.2f}")  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": rows, "summary": total}, indent=1) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
