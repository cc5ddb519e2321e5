"""The cache audit's cost: cached turns with the audit off vs on, in one engine, one run.

One engine (the defaults: the default model, its dtype and weights) and a shared context
of ``--context`` tokens; each round runs a cached turn (context + a new question) once
with the audit off — ``engine.audit`` None, exactly what ``audit_sample_rate`` 0 builds
— and once with it on at rate 1, in alternating order so drift cancels. With the audit
on, the turn's first-token logits row is copied to the host and, once the engine is
idle, the whole prompt is recomputed (the shadow prefill), timed apart from the turn.

Printed: the median cached turn off and on and their ratio; the shadow prefill's time
(what an idle engine spends per audited hit, and the most a request arriving during it
waits: one step of at most ``prefill_chunk_tokens``); and the off path's own work,
which is two ``is not None`` tests per step: timed here on the engine object and set
against the step count of the off turns. Run ``python -m radixserve.bench.cache_audit
[--context 1024] [--rounds 8] [--out FILE]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import timeit
from pathlib import Path

from radixserve.bench.synthetic import synthetic_tokens
from radixserve.engine.cache_audit import CacheAudit, audit_tolerance
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


def cached_turn(engine: Engine, prompt: list[int]) -> tuple[float, int, int]:
    """(seconds, steps, cached tokens) of one turn, up to its last token (not the idle
    shadow prefill after it)."""
    steps = engine.step_stats.engine_steps_total
    start = time.perf_counter()
    [result] = engine.generate([prompt], PARAMS)
    seconds = time.perf_counter() - start
    return seconds, engine.step_stats.engine_steps_total - steps, result.cached_tokens


def drain_audit(engine: Engine) -> float:
    """Step the idle engine through its pending shadow prefills; their seconds."""
    start = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - start


def measure(context_len: int, rounds: int) -> dict:
    engine = Engine(EngineSettings(load_progress=False, kv_cache_memory_gib=0.5))
    audit = CacheAudit(1.0, False, 20, audit_tolerance(engine.dtype), engine.tokenizer)
    context = synthetic_tokens(engine, context_len, seed=1)
    engine.generate([context + synthetic_tokens(engine, 16, seed=2)], PARAMS)  # cache it
    engine.audit = CacheAudit(1.0, False, 20, audit_tolerance(engine.dtype), engine.tokenizer)
    cached_turn(engine, context + synthetic_tokens(engine, 16, seed=3))  # warm both paths
    drain_audit(engine)
    off: list[float] = []
    on: list[float] = []
    shadow: list[float] = []
    off_steps = 0
    for i in range(rounds):
        for arm in ("off", "on") if i % 2 == 0 else ("on", "off"):
            engine.audit = audit if arm == "on" else None
            question = synthetic_tokens(engine, 16, seed=100 + 2 * i + (arm == "on"))
            seconds, steps, cached = cached_turn(engine, context + question)
            assert cached >= context_len - engine.page_size, cached
            if arm == "off":
                off.append(seconds)
                off_steps += steps
            else:
                on.append(seconds)
                shadow.append(drain_audit(engine))
    assert audit.num_checked == rounds and audit.num_mismatches == 0, audit.stats()
    engine.audit = None
    checks = 200_000  # the off path: `self.audit is not None`, twice per step
    check_s = timeit.timeit("engine.audit is not None", globals={"engine": engine}, number=checks)
    off_med, on_med = statistics.median(off), statistics.median(on)
    per_step_ns = 2 * check_s / checks * 1e9
    return {
        "model": engine.config.name,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "weights": engine.quantization,
        "context_tokens": context_len,
        "rounds": rounds,
        "cached_turn_off_ms": off_med * 1000,
        "cached_turn_on_ms": on_med * 1000,
        "on_over_off": on_med / off_med,
        "shadow_prefill_ms": statistics.median(shadow) * 1000,
        "shadow_chunk_tokens": engine.scheduler.prefill_chunk_tokens,
        "off_path_ns_per_step": per_step_ns,
        "off_path_share_of_turn": per_step_ns * 1e-9 * off_steps / rounds / off_med,
        "audits": audit.stats(),
    }


def report(r: dict) -> None:
    print(f"cache audit, {r['model']} {r['dtype']} ({r['weights']}), context {r['context_tokens']} "
          f"tokens, {r['rounds']} rounds")  # fmt: skip
    print(f"  cached turn, audit off   {r['cached_turn_off_ms']:9.1f} ms (median)")
    print(
        f"  cached turn, audit on    {r['cached_turn_on_ms']:9.1f} ms   on/off {r['on_over_off']:.3f}"
    )
    print(f"  shadow prefill (idle)    {r['shadow_prefill_ms']:9.1f} ms per audited hit "
          f"(steps of at most {r['shadow_chunk_tokens']} tokens)")  # fmt: skip
    print(f"  off path per step        {r['off_path_ns_per_step']:9.1f} ns "
          f"({100 * r['off_path_share_of_turn']:.5f} % of a cached turn)")  # fmt: skip
    print(f"  audits                   {r['audits']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=1024, help="shared context tokens")
    parser.add_argument("--rounds", type=int, default=8, help="cached turns per arm")
    parser.add_argument("--out", type=Path, help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.context < 64 or args.rounds < 1:
        parser.error("--context must be >= 64 and --rounds >= 1")
    result = measure(args.context, args.rounds)
    report(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
