"""The native CPU attention (`cpu/attention.c`): GFLOP/s of extend and decode calls.

SmolLM2-135M's shapes (9 q heads, 3 kv heads, head_dim 64, page size 16), bfloat16 pools:
a 512-row extend with no prefix and with a 1,024-token prefix (a prefill's first and
third chunk), and decode rows of a 1,500-token context, batch 1 and 8, each on 1 and 2
threads. GFLOP/s counts 4 · heads · head_dim per (row, key) pair attended (q·k and p·v);
medians of ``--repeats`` timed calls. Prints one table; ``--json`` writes its rows.

    .venv/bin/python kernels/bench_cpu_attention.py [--threads 1,2] [--repeats 9] [--json F]

Exits with a message where the native library is not to be had (no C compiler, another
CPU than x86 with no portable build).
"""

from __future__ import annotations

import radixserve  # noqa: F401  # first: OpenMP's wait policy, before torch loads

# isort: split

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from radixserve.kernels.cpu.attention import decode_attention, extend_attention, native_attention

HEADS, KV_HEADS, HEAD_DIM, PAGE = 9, 3, 64, 16
CONTEXT = 1536


def _median_s(call: Callable[[], torch.Tensor], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cases(gen: torch.Generator) -> list[tuple[str, Callable[[], torch.Tensor], int]]:
    """(name, call, (row, key) pairs attended) for each case."""
    pages = CONTEXT // PAGE + 8
    shape = (pages, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(torch.bfloat16)
    v = torch.randn(shape, generator=gen).to(torch.bfloat16)
    table = torch.arange(pages).unsqueeze(0)
    out: list[tuple[str, Callable[[], torch.Tensor], int]] = []
    for prefix in (0, 1024):
        rows = 512
        q = torch.randn((rows, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
        extend = functools.partial(extend_attention, q, k, v, torch.tensor([0, rows]),
                                   torch.tensor([prefix]), table, rows)  # fmt: skip
        pairs = sum(prefix + i + 1 for i in range(rows))
        out.append((f"extend 512 rows, prefix {prefix}", extend, pairs))
    for batch in (1, 8):
        q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
        decode = functools.partial(decode_attention, q, k, v,
                                   table.expand(batch, -1).contiguous(), torch.full((batch,), 1500))  # fmt: skip
        out.append((f"decode batch {batch}, context 1500", decode, batch * 1500))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    kernel = native_attention()
    if kernel is None:
        print("no native CPU kernels here (see kernels/README.md): nothing to time")
        return 1
    threads = [int(t) for t in args.threads.split(",")]
    rows = []
    print(f"native attention, path {kernel.path}; GFLOP/s (ms per call)")
    print("| case | " + " | ".join(f"{t} thread(s)" for t in threads) + " |")
    print("|---|" + "---|" * len(threads))
    for name, call, pairs in cases(torch.Generator().manual_seed(0)):
        cells = []
        for t in threads:
            torch.set_num_threads(t)
            seconds = _median_s(call, args.repeats)
            gflops = 4 * HEADS * HEAD_DIM * pairs / seconds / 1e9
            rows.append({"case": name, "threads": t, "ms": seconds * 1e3, "gflops": gflops})
            cells.append(f"{gflops:.0f} ({seconds * 1e3:.2f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"path": kernel.path, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
