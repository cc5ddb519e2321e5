"""GPU benchmark of the kernels (`python -m radixserve.bench.gpu` adds the engine on
them, end to end, in the same run).

    python -m radixserve.kernels.bench [--out kernels-bench.json]   # a CUDA machine
    python -m radixserve.kernels.bench --dry-run                    # tiny shapes, CPU

1. Ceilings, measured here: device copy bandwidth (bytes read + written) and the matmul
   rate of the compute dtype (bf16 on GPU).
2. Kernels at an 8B-class shape (32 q heads, 8 kv heads, head dim 128, page size 16):
   each Triton kernel against its torch reference and, for attention, PyTorch SDPA (and
   FlashAttention where installed) on dense K/V; µs and achieved GB/s or TFLOP/s as a
   fraction of the ceiling. FP8 projections (`quantization=fp8`) at the model's shapes
   against the dense bf16 matmul (the "triton" column is the FP8 layer, "torch ref" the
   dense one).
3. Tensor parallelism (`bench_tp.py`), with two GPUs or more: all-reduce bus bandwidth
   against the GPU-to-GPU copy rate; on one GPU a row saying it was skipped.
4. Fused MoE (`bench_moe.py`) against its reference at a Qwen3-30B-A3B-like layer.

Prints one table and the targets; writes JSON. `--dry-run` runs the same code at tiny
shapes on CPU (torch kernels and the Triton interpreter) so that it cannot rot; its
figures measure nothing.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import partial

import torch

logger = logging.getLogger("radixserve.kernels.bench")


@dataclass(frozen=True)
class Shapes:
    """Everything the run's size depends on."""

    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    hidden: int = 4096
    intermediate: int = 14336
    layers: int = 32
    vocab: int = 128256
    page_size: int = 16
    copy_mib: int = 2048
    matmul_n: int = 8192
    decode: tuple[tuple[int, int], ...] = ((1, 1024), (1, 32768), (32, 4096), (32, 32768),
                                           (128, 4096), (256, 1024))  # fmt: skip
    extend: tuple[tuple[int, int, int], ...] = (
        (1, 0, 4096),
        (1, 4096, 32),
        (1, 32768, 32),
        (8, 0, 1024),
        (1, 16384, 512),
    )  # (B, prefix, new); decode: (batch, context)
    tokens: tuple[int, ...] = (256, 4096)  # elementwise ops
    linear_rows: tuple[int, ...] = (1, 32, 256, 4096)  # fp8 vs dense projections
    pack_pages: int = 256
    reference_max_tokens: int = 1 << 20  # larger attention cases skip the torch reference
    kv_cache_gib: float = 40.0
    max_model_len: int = 33792
    batched_tokens: int = 8192
    prefill: tuple[int, int] = (4, 4096)  # prompts, tokens each
    ttft_contexts: tuple[int, ...] = (4096, 16384, 32768)
    delta: int = 32
    decode_batches: tuple[int, ...] = (1, 32, 128)
    decode_prompt: int = 512
    decode_steps: int = 32
    graph_max_batch: int = 128
    tp_layers: int = 8  # the engine's TP=2 vs TP=1 comparison: weights every rank loads
    budget_s: float = 450.0  # later cases are skipped past this


DRY = Shapes(
    heads=4, kv_heads=2, head_dim=16, hidden=64, intermediate=128, layers=2, vocab=512,
    page_size=4, copy_mib=8, matmul_n=128, decode=((1, 37), (3, 64)), extend=((1, 0, 24),
    (2, 21, 5)), tokens=(8,), pack_pages=4, kv_cache_gib=0.01, max_model_len=512,
    batched_tokens=256, prefill=(2, 48), ttft_contexts=(64, 128), delta=8,
    decode_batches=(1, 4), decode_prompt=16, decode_steps=3, graph_max_batch=4, budget_s=120.0,
    tp_layers=2, linear_rows=(1, 5),
)  # fmt: skip


@dataclass
class Row:
    section: str
    case: str
    triton_us: float | None = None
    reference_us: float | None = None
    sdpa_us: float | None = None
    flash_us: float | None = None
    achieved: str = ""
    of_ceiling: float | None = None  # fraction
    extra: dict = field(default_factory=dict)


class Clock:
    """Median wall time of a callable: CUDA events on a GPU, perf_counter on CPU."""

    def __init__(self, device: torch.device, reps: int) -> None:
        self.device, self.reps = device, reps

    def us(self, fn: Callable[[], object]) -> float:
        fn()  # warm-up: compiles Triton kernels, fills caches
        times = []
        for _ in range(self.reps):
            if self.device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return sorted(times)[len(times) // 2]


@dataclass
class Run:
    shapes: Shapes
    device: torch.device
    dtype: torch.dtype
    clock: Clock
    copy_gbps: float = 0.0
    matmul_tflops: float = 0.0
    rows: list[Row] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)

    def over_budget(self, what: str) -> bool:
        if time.perf_counter() - self.started < self.shapes.budget_s:
            return False
        self.rows.append(Row("skipped", what, achieved="time budget spent"))
        return True


def num(x: float) -> str:
    """Three significant digits at least, thousands separated: 4,312 / 37.5 / 0.0123."""
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}"


def measure_ceilings(run: Run) -> None:
    n = run.shapes.copy_mib * (1 << 20) // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=run.device).normal_()
    dst = torch.empty_like(src)
    us = run.clock.us(lambda: dst.copy_(src))
    run.copy_gbps = 2 * src.numel() * 2 / us / 1e3
    m = run.shapes.matmul_n
    a = torch.randn(m, m, device=run.device).to(run.dtype)
    b = torch.randn(m, m, device=run.device).to(run.dtype)
    us = run.clock.us(lambda: a @ b)
    run.matmul_tflops = 2 * m**3 / us / 1e6
    run.rows.append(
        Row("ceiling", f"copy {run.shapes.copy_mib} MiB", achieved=f"{num(run.copy_gbps)} GB/s")
    )
    run.rows.append(Row("ceiling", f"{str(run.dtype)[6:]} matmul {m}³",
                        achieved=f"{num(run.matmul_tflops)} TFLOP/s"))  # fmt: skip


@dataclass
class Case:
    """One kernel at one shape: the Triton call, its reference, peers on dense K/V, and
    the work it does (bytes moved or FLOPs) for the achieved rate."""

    section: str
    name: str
    triton: Callable[[], object]
    reference: Callable[[], object] | None
    peers: dict[str, Callable[[], object]] = field(default_factory=dict)
    nbytes: int = 0
    flops: float = 0.0
    extra: dict = field(default_factory=dict)


def measure(run: Run, case: Case) -> None:
    if run.over_budget(f"{case.section} {case.name}"):
        return
    t_us = run.clock.us(case.triton)
    row = Row(case.section, case.name, t_us, extra=dict(case.extra))
    if case.reference is not None:
        row.reference_us = run.clock.us(case.reference)
    if "sdpa" in case.peers:
        row.sdpa_us = run.clock.us(case.peers["sdpa"])
    if "flash" in case.peers:
        row.flash_us = run.clock.us(case.peers["flash"])
    if case.flops:
        tflops = case.flops / t_us / 1e6
        row.achieved, row.of_ceiling = f"{num(tflops)} TFLOP/s", tflops / run.matmul_tflops
    else:
        gbps = case.nbytes / t_us / 1e3
        row.achieved, row.of_ceiling = f"{num(gbps)} GB/s", gbps / run.copy_gbps
    run.rows.append(row)


def paged_pool(run: Run, batch: int, seq_len: int):
    """K/V caches holding `batch` sequences of `seq_len` tokens in shuffled pages."""
    s = run.shapes
    width = -(-seq_len // s.page_size)
    shape = (width * batch, s.page_size, s.kv_heads, s.head_dim)
    k = torch.randn(shape, device=run.device).to(run.dtype)
    v = torch.randn(shape, device=run.device).to(run.dtype)
    table = torch.randperm(width * batch, device=run.device).view(batch, width)
    return k, v, table


def dense_peers(run: Run, q4, k, v, table, n: int, mask) -> dict[str, Callable[[], object]]:
    """SDPA, and FlashAttention where installed, on the first n tokens of every table row
    as dense tensors. q4 (B, H, n_q, D); mask None means square causal (or none if n_q=1)."""
    s = run.shapes
    group = s.heads // s.kv_heads
    kd, vd = (c[table].flatten(1, 2)[:, :n] for c in (k, v))  # (B, n, H_kv, D)
    kh, vh = (x.transpose(1, 2).repeat_interleave(group, 1).contiguous() for x in (kd, vd))
    causal = mask is None and q4.shape[2] > 1
    sdpa = torch.nn.functional.scaled_dot_product_attention
    peers: dict[str, Callable[[], object]] = {
        "sdpa": lambda: sdpa(q4, kh, vh, attn_mask=mask, is_causal=causal)
    }
    try:
        from flash_attn import flash_attn_func  # type: ignore[import-not-found]
    except Exception:
        return peers
    if run.device.type == "cuda":
        qf, kf, vf = q4.transpose(1, 2).contiguous(), kd.contiguous(), vd.contiguous()
        # flash-attn's causal mask is bottom-right aligned, as ours
        peers["flash"] = lambda: flash_attn_func(qf, kf, vf, causal=q4.shape[2] > 1)
    return peers


def decode_cases(run: Run, ops, ref, batch: int, ctx: int) -> list[Case]:
    from radixserve.kernels.triton.decode_attention import default_num_splits

    s = run.shapes
    k, v, table = paged_pool(run, batch, ctx)
    lens = torch.full((batch,), ctx, dtype=torch.int64, device=run.device)
    q = torch.randn(batch, s.heads, s.head_dim, device=run.device).to(run.dtype)
    splits = default_num_splits(batch, s.kv_heads, ctx, _compute_units(run.device))
    small = batch * ctx <= s.reference_max_tokens
    case = Case(
        "decode_attention", f"B={batch} ctx={ctx} splits={splits}",
        lambda: ops.decode_attention(q, k, v, table, lens, splits),
        (lambda: ref.decode_attention(q, k, v, table, lens)) if small else None,
        dense_peers(run, q[:, :, None], k, v, table, ctx, None),
        nbytes=2 * batch * ctx * s.kv_heads * s.head_dim * k.element_size(),  # K, V read once
        extra={"batch": batch, "context": ctx},
    )  # fmt: skip
    return [case]


def extend_cases(run: Run, ops, ref, batch: int, prefix: int, new: int) -> list[Case]:
    s, dev = run.shapes, run.device
    k, v, table = paged_pool(run, batch, prefix + new)
    q = torch.randn(batch * new, s.heads, s.head_dim, device=dev).to(run.dtype)
    cu = torch.arange(0, batch * new + 1, new, device=dev)
    prefix_lens = torch.full((batch,), prefix, dtype=torch.int64, device=dev)
    args = (q, k, v, cu, prefix_lens, table, new)
    q4 = q.view(batch, new, s.heads, s.head_dim).transpose(1, 2)  # (B, H, new, D)
    mask = None if prefix == 0 else _lower_right(new, prefix + new, dev)
    small = batch * (prefix + new) <= s.reference_max_tokens
    case = Case(
        "extend_attention", f"B={batch} prefix={prefix} new={new}",
        lambda: ops.extend_attention(*args),
        (lambda: ref.extend_attention(*args)) if small else None,
        dense_peers(run, q4, k, v, table, prefix + new, mask),
        # QK^T and PV over visible keys: query i sees prefix + i + 1 of them
        flops=4.0 * s.heads * s.head_dim * batch * (new * prefix + new * (new + 1) / 2),
        extra={"batch": batch, "prefix": prefix, "new": new},
    )  # fmt: skip
    return [case]


def _lower_right(n: int, total: int, device: torch.device):
    """Bottom-right causal mask for n queries after total - n cached keys: SDPA's bias
    object where torch has it (it keeps the fused kernels), else a boolean mask."""
    try:
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(n, total)
    except Exception:
        keys = torch.arange(total, device=device)
        return keys[None, :] <= torch.arange(total - n, total, device=device)[:, None]


def _compute_units(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def elementwise_cases(run: Run, ops, ref, t: int) -> list[Case]:
    """rmsnorm (+residual), rope, silu_and_mul and store_kv on t tokens."""
    s, el = run.shapes, torch.empty((), dtype=run.dtype).element_size()
    rand = _rand(run)
    x, r, w = rand(t, s.hidden), rand(t, s.hidden), rand(s.hidden)
    qkv = rand(t, (s.heads + 2 * s.kv_heads) * s.head_dim)
    q = qkv[:, : s.heads * s.head_dim].view(t, s.heads, s.head_dim)
    k = qkv[:, s.heads * s.head_dim :][:, : s.kv_heads * s.head_dim].view(t, s.kv_heads, -1)
    angles = torch.rand(t, s.head_dim // 2, device=run.device) * 6
    rope = (q, k, torch.arange(t, device=run.device), angles.cos(), angles.sin())
    gate_up = rand(t, 2 * s.intermediate)
    pages = -(-t // s.page_size) + 1
    caches = [rand(pages, s.page_size, s.kv_heads, s.head_dim) for _ in range(2)]
    slots = torch.randperm(pages * s.page_size, device=run.device)[:t]
    kv = [rand(t, s.kv_heads, s.head_dim) for _ in range(2)]
    store = (*caches, slots, *kv)
    return [
        Case("rmsnorm+residual", f"{t} tokens", lambda: ops.rmsnorm(x, w, 1e-5, r),
             lambda: ref.rmsnorm(x, w, 1e-5, r), nbytes=4 * t * s.hidden * el),
        Case("rope", f"{t} tokens", lambda: ops.rope(*rope), lambda: ref.rope(*rope),
             nbytes=2 * (q.numel() + k.numel()) * el),
        Case("silu_and_mul", f"{t} tokens", lambda: ops.silu_and_mul(gate_up),
             lambda: ref.silu_and_mul(gate_up), nbytes=3 * t * s.intermediate * el),
        Case("store_kv", f"{t} tokens", lambda: ops.store_kv(*store), lambda: ref.store_kv(*store),
             nbytes=4 * kv[0].numel() * el),
    ]  # fmt: skip


def page_cases(run: Run, ops, ref) -> list[Case]:
    s, n = run.shapes, run.shapes.pack_pages
    pool = _rand(run)(s.layers, 2, 2 * n, s.page_size, s.kv_heads, s.head_dim)
    ids = torch.randperm(2 * n, device=run.device)[:n]
    packed = ops.pack_pages(pool, ids)
    moved = 2 * packed.numel() * packed.element_size()  # read and written
    name = f"{n} pages x {s.layers} layers"
    return [
        Case("pack_pages", name, lambda: ops.pack_pages(pool, ids, packed),
             lambda: ref.pack_pages(pool, ids, packed), nbytes=moved),
        Case("unpack_pages", name, lambda: ops.unpack_pages(pool, ids, packed),
             lambda: ref.unpack_pages(pool, ids, packed), nbytes=moved),
    ]  # fmt: skip


def linear_cases(run: Run, rows: int) -> list[Case]:
    """`quantization=fp8` projections (e4m3 weights with per-row scales, activations
    quantized per row, `torch._scaled_mm`) against the dense matmul of the compute dtype,
    at the model's qkv, gate/up and down shapes."""
    from radixserve.model.qlinear import Fp8Linear
    from radixserve.model.quant import quantize

    s, cases = run.shapes, []
    qkv = (s.heads + 2 * s.kv_heads) * s.head_dim
    for name, n, k in (("qkv", qkv, s.hidden), ("gate_up", 2 * s.intermediate, s.hidden),
                       ("down", s.hidden, s.intermediate)):  # fmt: skip
        w = torch.randn(n, k, device=run.device) * 0.02
        layer = Fp8Linear(n, k, run.dtype, run.device)
        layer.load(0, quantize(w, "fp8"))
        dense = w.to(run.dtype)
        x = torch.randn(rows, k, device=run.device).to(run.dtype)
        cases.append(Case("fp8_linear", f"{name} {n}x{k}, {rows} rows", partial(layer, x),
                          partial(torch.nn.functional.linear, x, dense),
                          flops=2.0 * rows * n * k, extra={"rows": rows}))  # fmt: skip
    return cases


def _rand(run: Run) -> Callable[..., torch.Tensor]:
    return lambda *shape: torch.randn(*shape, device=run.device).to(run.dtype)


def bench_kernels(run: Run, ops, ref) -> None:
    """Each job builds its cases, measures them and drops them before the next (the big
    ones take GiBs)."""
    s = run.shapes
    jobs: list[Callable[[], list[Case]]] = []
    jobs += [partial(decode_cases, run, ops, ref, b, c) for b, c in s.decode]
    jobs += [partial(extend_cases, run, ops, ref, *e) for e in s.extend]
    jobs += [partial(elementwise_cases, run, ops, ref, t) for t in s.tokens]
    jobs.append(partial(page_cases, run, ops, ref))
    jobs += [partial(linear_cases, run, rows) for rows in s.linear_rows]
    from radixserve.kernels.bench_moe import moe_cases

    jobs.append(lambda: [Case(**fields) for fields in moe_cases(run, ops, ref)])
    for job in jobs:
        guarded(run, "kernel case", partial(_measure_all, run, job))
        if run.device.type == "cuda":
            torch.cuda.empty_cache()


def _measure_all(run: Run, job: Callable[[], list[Case]]) -> None:
    for case in job():
        measure(run, case)


# -- targets, output ---------------------------------------------------------------------


def targets(run: Run) -> list[Row]:
    s, out = run.shapes, []
    longest = max(ctx for _, ctx in s.decode)
    for r in run.rows:
        if r.section == "decode_attention" and r.extra.get("context") == longest:
            out.append(target(f"decode attention, {r.case}: >= 70% of copy bandwidth",
                               r.of_ceiling, 0.70))  # fmt: skip
        if r.section == "extend_attention" and r.extra.get("prefix") == 0 and r.extra["batch"] == 1:
            out.append(target(f"extend attention, {r.case}: >= 50% of the matmul rate",
                               r.of_ceiling, 0.50))  # fmt: skip
    return out


def target(what: str, value: float | None, need: float, shown: str | None = None) -> Row:
    if value is None:
        return Row("target", what, achieved="not measured")
    text = shown or f"{value:.0%}"
    return Row("target", what, achieved=f"{text} {'PASS' if value >= need else 'FAIL'}",
               extra={"value": value, "need": need})  # fmt: skip


def table(rows: list[Row]) -> str:
    def us(x: float | None) -> str:
        return "" if x is None else f"{x:,.1f}"

    lines = ["| section | case | triton µs | torch ref µs | SDPA µs | FA µs | achieved | of ceiling |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        pct = "" if r.of_ceiling is None else f"{r.of_ceiling:.0%}"
        lines.append(f"| {r.section} | {r.case} | {us(r.triton_us)} | {us(r.reference_us)} | "
                     f"{us(r.sdpa_us)} | {us(r.flash_us)} | {r.achieved} | {pct} |")  # fmt: skip
    return "\n".join(lines)


def bench_tp(run: Run) -> None:
    """All-reduce over the GPUs at a decode step's and a prefill chunk's hidden states."""
    from radixserve.kernels.bench_tp import measure_all_reduce, rows_of

    s, rows = run.shapes, [max(run.shapes.decode_batches), run.shapes.batched_tokens]
    found = measure_all_reduce(run.device, run.dtype, s.hidden, rows)
    run.rows += [Row("tp", **row) for row in rows_of(found, s.hidden, num)]


def guarded(run: Run, name: str, fn: Callable[[], None]) -> None:
    """A failing section is recorded in the table; the others still run."""
    try:
        fn()
    except Exception as exc:
        logger.exception("%s failed", name)
        run.rows.append(Row("error", name, achieved=f"{type(exc).__name__}: {exc}"[:200]))


def main(
    argv: list[str] | None = None,
    more: Callable[[Run], None] | None = None,
    more_targets: Callable[[Run], list[Row]] | None = None,
) -> int:
    """The kernels' benchmark; ``more`` runs further sections in the same run (and
    ``more_targets`` their targets), as `radixserve.bench.gpu` does with the engine."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on CPU (interpreted Triton)")
    p.add_argument("--out", default="kernels-bench.json", help="JSON results path")
    if more is not None:
        p.add_argument("--no-engine", action="store_true", help="kernels only")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if not args.dry_run and not torch.cuda.is_available():
        print("this benchmark needs a CUDA GPU; --dry-run runs tiny shapes on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before the Triton kernels are first imported
    from radixserve.kernels import reference
    from radixserve.kernels.ops import load_ops

    device = torch.device("cpu" if args.dry_run else "cuda")
    dtype = torch.float32 if args.dry_run else torch.bfloat16
    run = Run(
        DRY if args.dry_run else Shapes(), device, dtype, Clock(device, 1 if args.dry_run else 20)
    )
    guarded(run, "ceilings", lambda: measure_ceilings(run))
    bench_kernels(run, load_ops("triton"), reference.OPS)
    guarded(run, "tp", lambda: bench_tp(run))
    if more is not None and not args.no_engine:
        guarded(run, "engine", lambda: more(run))
    run.rows += targets(run) + (more_targets(run) if more_targets is not None else [])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    title = f"kernels benchmark — {name}, {str(dtype)[6:]}" + (
        " (dry run: tiny shapes, figures mean nothing)" if args.dry_run else ""
    )
    print(title + "\n\n" + table(run.rows))
    result = {"device": name, "dtype": str(dtype), "dry_run": args.dry_run,
              "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "copy_gbps": run.copy_gbps, "matmul_tflops": run.matmul_tflops,
              "shapes": asdict(run.shapes), "rows": [asdict(r) for r in run.rows]}  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"\nwrote {args.out}")
    return 1 if any(r.section == "error" for r in run.rows) else 0


if __name__ == "__main__":
    sys.exit(main())
