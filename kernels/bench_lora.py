"""The batched LoRA matmul on CPU: the native kernel (`cpu/lora.c`) against its reference
and against the base projection it rides on.

For each of SmolLM2-135M's four projections (K inputs, M outputs), N rows spread evenly
over 4 adapters of rank 16, bfloat16, times:

- ``native``: `cpu/lora.py` with B as the adapters give it, (L, M, R) contiguous;
- ``native-rm``: the same with B stored (L, R, M) and passed as ``.transpose(1, 2)`` (the
  kernel's vectors run along M: no transposition per call);
- ``reference``: `reference/lora.py` (the torch set's path without a C compiler);
- ``base-bf16``: ``F.linear`` of the same rows by a dense (M, K) bfloat16 weight, the
  projection the update is added to, for scale.

Best of repeated calls (the machine may be shared). One table on stdout; ``--json``
writes the rows.

    .venv/bin/python kernels/bench_lora.py [--rows 16,256] [--threads 1] [--json out.json]
"""

from __future__ import annotations

import radixserve  # noqa: F401  # first: OpenMP's wait policy, before torch loads

# isort: split

import argparse
import json
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.kernels.cpu.lora import lora_apply, native_lora
from radixserve.kernels.reference.lora import lora_apply as reference_lora_apply

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}
ADAPTERS, RANK = 4, 16


def time_s(fn: Callable[[], object], budget_s: float) -> float:
    """Best seconds per call over batches that fill the budget."""
    fn()
    best, spent = float("inf"), 0.0
    while spent < budget_s:
        start = time.perf_counter()
        calls = 0
        while time.perf_counter() - start < budget_s / 5:
            fn()
            calls += 1
        took = time.perf_counter() - start
        best, spent = min(best, took / calls), spent + took
    return best


def case(rows: int, k: int, m: int) -> dict[str, Callable[[], object]]:
    """name → call, for one shape and number of rows."""
    g = torch.Generator().manual_seed(k + m)
    dt = torch.bfloat16
    x = torch.randn(rows, k, generator=g).to(dt)  # (N, K)
    y = torch.randn(rows, m, generator=g).to(dt)  # (N, M)
    a = (torch.randn(ADAPTERS, RANK, k, generator=g) * k**-0.5).to(dt)  # (L, R, K)
    b = (torch.randn(ADAPTERS, m, RANK, generator=g) * 0.01).to(dt)  # (L, M, R)
    b_rm = b.transpose(1, 2).contiguous().transpose(1, 2)  # stored (L, R, M)
    slots = torch.arange(rows) % ADAPTERS  # (N,)
    scaling = torch.full((ADAPTERS,), 2.0)
    w = torch.randn(m, k, generator=g).to(dt)  # (M, K) the base weight
    return {
        "native": lambda: lora_apply(x, y, a, b, slots, scaling),
        "native-rm": lambda: lora_apply(x, y, a, b_rm, slots, scaling),
        "reference": lambda: reference_lora_apply(x, y, a, b, slots, scaling),
        "base-bf16": lambda: F.linear(x, w),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="16", help="comma-separated numbers of rows")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--budget-s", type=float, default=0.3, help="seconds per timing")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    if native_lora() is None:
        raise SystemExit("no native kernel (no C compiler and nothing prebuilt)")
    torch.set_num_threads(args.threads)
    results = []
    print(f"{'shape':8} {'K':>5} {'M':>5} {'rows':>5} {'native':>9} {'native-rm':>10} "
          f"{'reference':>10} {'base-bf16':>10} {'ref/native':>10}   (µs, {args.threads} thread(s), "
          f"{ADAPTERS} adapters of rank {RANK})")  # fmt: skip
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (k, m) in SHAPES.items():
            us = {key: time_s(call, args.budget_s) * 1e6 for key, call in case(rows, k, m).items()}
            results.append({"shape": name, "k": k, "m": m, "rows": rows,
                            "threads": args.threads, **{f"{key}_us": v for key, v in us.items()}})  # fmt: skip
            print(f"{name:8} {k:5} {m:5} {rows:5} {us['native']:9.1f} {us['native-rm']:10.1f} "
                  f"{us['reference']:10.1f} {us['base-bf16']:10.1f} "
                  f"{us['reference'] / us['native']:9.1f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
