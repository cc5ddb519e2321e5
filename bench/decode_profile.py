"""Where a decode step's time goes in the engine: the default model and settings, B
sequences decoding at a context of about C tokens; the median of each part over 40
steps: the whole step, the native step's layers and its LM head (the final norm with
it), the forward as a whole, scheduling, sampling and appending the tokens.

    .venv/bin/python bench/decode_profile.py [--batch 1] [--context 2000]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time
from collections.abc import Callable
from typing import Any

from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

STEPS = 40


def profile(batch: int, context: int) -> dict[str, float]:
    """Median ms per step of each part (module notes)."""
    engine = Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                                   kv_cache_memory_gib=0.5, prefix_cache=False))  # fmt: skip
    times: dict[str, list[float]] = collections.defaultdict(list)

    class Timed:
        """``call`` timed into ``times[part]``; its attributes read through (the native
        step's ``threads``)."""

        def __init__(self, call: Callable[..., Any], part: str) -> None:
            self.call, self.part = call, part

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            out = self.call(*args, **kwargs)
            times[self.part].append(time.perf_counter() - start)
            return out

        def __getattr__(self, name: str) -> Any:
            return getattr(self.call, name)

    def timed(obj: Any, name: str, part: str) -> None:
        setattr(obj, name, Timed(getattr(obj, name), part))

    timed(engine.scheduler, "schedule", "schedule")
    timed(engine.runner, "run", "forward")
    timed(engine.choices, "sample", "sample")
    timed(engine, "_append", "append (per token)")
    if (fused := engine.runner.fused) is not None:  # its two parts, as it runs them
        timed(fused, "step", "layers (native step)")
        timed(fused.model, "logits", "LM head")
    tok = engine.tokenizer
    base = tok.encode("The harbour master kept a log of every ship. " * (context // 8))[:context]
    params = SamplingParams(max_tokens=STEPS + 20, min_tokens=STEPS + 20, temperature=0.0)
    for i in range(batch):
        engine.add_request([*base, *tok.encode(f" {i}")], params)
    running = engine.scheduler.running
    while len(running) < batch or not all(r.output_ids for r in running):
        engine.step()  # the prompts
    for _ in range(3):
        engine.step()
    times.clear()
    for _ in range(STEPS):
        start = time.perf_counter()
        engine.step()
        times["step"].append(time.perf_counter() - start)
    return {part: statistics.median(t) * 1e3 for part, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=2000)
    args = parser.parse_args()
    parts = profile(args.batch, args.context)
    print(f"decode step, batch {args.batch}, ~{args.context} tokens of context (ms, median):")
    for part, ms in parts.items():
        print(f"  {part:24s} {ms:8.3f}")


if __name__ == "__main__":
    main()
