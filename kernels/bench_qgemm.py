"""The quantized GEMM on CPU against PyTorch's kernels, in one run: GFLOP/s and GB/s.

For each weight shape (SmolLM2-135M's four projections and Llama-3-8B's down projection),
rows of x (1 to 512: a decode step to a prefill chunk) and thread count, times:

- ``qgemm-int4``, ``qgemm-int8``: `cpu/qgemm.c` (int4 with groups of 32, int8 per row);
- ``torch-int4``, ``torch-int8``: PyTorch's ``_weight_int4pack_mm_for_cpu`` /
  ``_weight_int8pack_mm`` (what the layers run without the C kernel, up to 16 / 32 rows);
- ``torch-int4-dense``: the fallback above 16 rows (dequantize to float32, bfloat16 hi/lo
  halves, one dense matmul of twice the K);
- ``dense-bf16``: ``F.linear`` on a bfloat16 weight (``quantization=none``).

Each call reads another copy of the weight, round robin over copies that total more than
the last-level cache, so the weights come from memory as in a model's forward, and the
GB/s (the weight's bytes, with x and y, per second) stand against the copy bandwidth
measured first at the same thread count. One table on stdout; ``--json`` writes the rows.

    .venv/bin/python kernels/bench_qgemm.py [--threads 1,2] [--quick] [--json out.json]
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

from radixserve.kernels.cpu.qgemm import QGemm, native_qgemm, pack_int4, pack_int8

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "8B down": (4096, 14336)}  # fmt: skip
ROWS = (1, 4, 16, 64, 256, 512)
GROUP = 32
COLD_BYTES = 96 << 20  # more than the last-level cache: every copy read comes from memory


def copy_bandwidth_gbs(budget_s: float) -> float:
    """Memory bandwidth: bytes read and written per second copying 256 MiB."""
    src = torch.empty(64 << 20, dtype=torch.float32).fill_(1.0)
    dst = torch.empty_like(src)
    seconds = time_s(lambda: dst.copy_(src), budget_s)
    return 2 * src.nbytes / seconds / 1e9


def time_s(fn: Callable[[], object], budget_s: float) -> float:
    """Best seconds per call over batches that fill the budget (the machine is shared)."""
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


class Weights:
    """Copies of one (N, K) weight in every layout the kernels take, round robin."""

    def __init__(self, n: int, k: int) -> None:
        g = torch.Generator().manual_seed(n + k)
        q4 = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
        q8 = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
        scale = torch.rand(k // GROUP, n, generator=g) * 0.02 + 1e-3
        self.sz = torch.stack((scale, torch.zeros_like(scale)), -1).to(torch.bfloat16)
        self.scale8 = scale[0].to(torch.bfloat16).contiguous()
        copies = max(1, COLD_BYTES // (n * k))  # the int8 weight's bytes
        self.q4 = [pack_int4(q4) for _ in range(copies)]
        self.q8 = [pack_int8(q8) for _ in range(copies)]
        torch_q4 = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q4.to(torch.int32), 1)
        self.torch_q4 = [torch_q4.clone() for _ in range(copies)]
        self.torch_q8 = [q8.clone() for _ in range(copies)]
        self.codes4 = [q4.clone() for _ in range(max(1, copies // 2))]
        self.w16 = [torch.randn(n, k, generator=g).to(torch.bfloat16)
                    for _ in range(max(1, copies // 2))]  # fmt: skip
        self.turn = 0

    def next(self, copies: list[torch.Tensor]) -> torch.Tensor:
        self.turn += 1
        return copies[self.turn % len(copies)]


def kernels(w: Weights, qgemm: QGemm, x: torch.Tensor) -> dict[str, tuple[Callable, int]]:
    """name → (call, weight bytes it reads)."""
    n, k = w.sz.shape[1], x.shape[1]
    int4_bytes, int8_bytes = n * k // 2 + w.sz.nbytes, n * k + w.scale8.nbytes

    def torch_dense() -> torch.Tensor:  # the layers' fallback above 16 rows
        q = w.next(w.codes4).view(n, k // GROUP, GROUP).float()
        sz = w.sz.float().transpose(0, 1)  # (N, K/G, 2)
        wf = q.sub_(8).mul_(sz[..., :1]).add_(sz[..., 1:]).view(n, k)  # torch ops, as qlinear's
        hi = wf.to(torch.bfloat16)
        pair = torch.cat((hi, (wf - hi.float()).to(torch.bfloat16)), 1)
        return F.linear(torch.cat((x, x), 1), pair)

    return {
        "qgemm-int4": (lambda: qgemm.int4(x, w.next(w.q4), w.sz, GROUP), int4_bytes),
        "qgemm-int8": (lambda: qgemm.int8(x, w.next(w.q8), w.scale8), int8_bytes),
        "torch-int4": (
            lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(x, w.next(w.torch_q4), GROUP, w.sz),
            int4_bytes,
        ),  # fmt: skip
        "torch-int8": (
            lambda: torch.ops.aten._weight_int8pack_mm(x, w.next(w.torch_q8), w.scale8),
            int8_bytes,
        ),  # fmt: skip
        "torch-int4-dense": (torch_dense, int4_bytes),
        "dense-bf16": (lambda: F.linear(x, w.next(w.w16)), 2 * n * k),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    parser.add_argument("--budget-s", type=float, default=0.25, help="timing per cell")
    parser.add_argument("--quick", action="store_true", help="gate_up and 8B down only")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args()
    qgemm = native_qgemm()
    if qgemm is None:
        raise SystemExit("no native quantized GEMM here (no C compiler): nothing to time")
    shapes = {s: SHAPES[s] for s in ("gate_up", "8B down")} if args.quick else SHAPES
    rows = []
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        bandwidth = copy_bandwidth_gbs(args.budget_s)
        print(f"threads {threads}: copy bandwidth {bandwidth:.1f} GB/s, kernel {qgemm.path}")
        print(f"{'shape':8} {'N x K':>11} {'rows':>4} {'kernel':17} {'ms':>8} {'GFLOP/s':>8} "
              f"{'GB/s':>6} {'% bw':>5}")  # fmt: skip
        for name, (n, k) in shapes.items():
            weights = Weights(n, k)
            for m in ROWS:
                x = torch.randn(m, k).to(torch.bfloat16)
                for kernel, (call, nbytes) in kernels(weights, qgemm, x).items():
                    seconds = time_s(call, args.budget_s)
                    gflops = 2 * m * n * k / seconds / 1e9
                    gbs = (nbytes + x.nbytes + 2 * m * n) / seconds / 1e9
                    rows.append(dict(threads=threads, shape=name, n=n, k=k, rows=m,
                                     kernel=kernel, ms=seconds * 1e3, gflops=gflops, gbs=gbs,
                                     copy_gbs=bandwidth))  # fmt: skip
                    print(f"{name:8} {f'{n}x{k}':>11} {m:>4} {kernel:17} {seconds * 1e3:>8.3f} "
                          f"{gflops:>8.1f} {gbs:>6.1f} {100 * gbs / bandwidth:>5.0f}",
                          flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"kernel": qgemm.path, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
