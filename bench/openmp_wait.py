"""OpenMP's idle threads spinning (libgomp's default) vs waiting passively (radixserve's).

    .venv/bin/python bench/openmp_wait.py [--repeats 3] [--tokens 1500] [--out F.json]

radixserve sets ``OMP_WAIT_POLICY=PASSIVE`` when it is imported before torch and the
variable is unset (`radixserve/__init__.py`). This measures why, in one run: the engine
with the default model and settings, each time in a fresh process, its torch threads
the machine's cores, the two policies alternating:

- ``spin``: the variable unset and torch imported before radixserve, so libgomp keeps
  its default (its idle threads spin a while after each parallel region);
- ``passive``: as radixserve starts.

Each process times an uncached prefill of ``--tokens`` prompt tokens (the median of 3,
after one warm-up) and the inter-token latency of 4 sequences decoding 64 tokens
together. Prints each run, the medians and passive ÷ spin.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

POLICIES = ("spin", "passive")

CHILD = """
import json, os, random, statistics, sys, time
import torch  # first: libgomp reads its environment as torch loads it
import radixserve
from radixserve.engine.engine import Engine
from radixserve.engine.sampling_params import SamplingParams
from radixserve.settings import EngineSettings

tokens = int(sys.argv[1])
engine = Engine(EngineSettings(model="default", device="cpu", load_progress=False,
                               prefix_cache=False))
rng = random.Random(0)
words = "alpha beta gamma delta river mountain system prompt token cache".split()
ids = engine.tokenizer.encode(" ".join(rng.choice(words) for _ in range(tokens)))[:tokens]
one = SamplingParams(max_tokens=1, temperature=0)
engine.generate([ids[: tokens // 2]], one)
prefill = []
for i in range(3):
    start = time.perf_counter()
    engine.generate([[i + 1] + ids[1:]], one)
    prefill.append(time.perf_counter() - start)
decode = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
results = engine.generate([[i + 10] + ids[1:200] for i in range(4)], decode)
itl = statistics.mean((r.e2e_ms - r.ttft_ms) / 63 for r in results)
print(json.dumps({"prefill_ms": statistics.median(prefill) * 1e3, "itl_ms": itl,
                  "policy": os.environ.get("OMP_WAIT_POLICY", "")}))
"""


def run_once(policy: str, tokens: int) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    if policy == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", CHILD, str(tokens)], env=env, check=True,
                         capture_output=True, text=True, timeout=900)  # fmt: skip
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=1500)
    parser.add_argument("--out", help="write the runs and medians here (JSON)")
    args = parser.parse_args(argv)
    print(f"engine, default model and settings, {os.cpu_count()} cores; "
          f"{args.tokens}-token uncached prefill, 4 sequences decoding")  # fmt: skip
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in POLICIES}
    for i in range(args.repeats):
        for policy in POLICIES:
            row = run_once(policy, args.tokens)
            runs[policy].append(row)
            print(f"run {i + 1} {policy:8s} prefill {row['prefill_ms']:7.0f} ms   "
                  f"ITL {row['itl_ms']:6.2f} ms")  # fmt: skip
    medians = {
        p: {key: statistics.median(r[key] for r in rows) for key in ("prefill_ms", "itl_ms")}
        for p, rows in runs.items()
    }
    spin, passive = medians["spin"], medians["passive"]
    print(
        f"medians: spin prefill {spin['prefill_ms']:.0f} ms, ITL {spin['itl_ms']:.2f} ms; "
        f"passive prefill {passive['prefill_ms']:.0f} ms, ITL {passive['itl_ms']:.2f} ms"
    )
    print(f"passive / spin: prefill {passive['prefill_ms'] / spin['prefill_ms']:.2f}x, "
          f"ITL {passive['itl_ms'] / spin['itl_ms']:.2f}x")  # fmt: skip
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"runs": runs, "medians": medians}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
