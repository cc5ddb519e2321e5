"""Decode attention on CPU: `cpu.decode_attention` against the torch reference, in one run.

SmolLM2-135M's attention shapes (9 q heads, 3 kv heads, head_dim 64, page size 16), batch
1/4/16, contexts 256/1024/4096, float32 and bfloat16, with each sequence's pages laid out
three ways: contiguous (one run), scattered (every page alone) and mixed (a contiguous
prompt, then one page in every `batch` as concurrent decodes grow). Times whole steps (30
layers, one plan each), the two kernels' steps alternating, and prints one table of
microseconds per layer (medians) and the ratio reference / new; `--json` writes the rows.

    .venv/bin/python kernels/bench_cpu_decode.py [--threads N] [--json out.json] [--runs]

``--runs`` instead times the CPU decode on the page tables the page allocator makes for a
batch prefilled one sequence after another and then decoding together (a prompt of 25 %
or 75 % of the context, the rest grown a token at a time): with its reservations (each
sequence's decode pages in runs aligned to the decode's blocks, read in place) and
without them (decode pages interleaved across the batch, gathered), same tokens, steps
alternating, and prints the ratio; the two outputs are checked equal bit for bit. It times this kernel and, where the torch set
decodes with another (the native one, which reads K/V through the page table), that
one too.

``--layouts`` instead times the choice of pool layout (radixserve/transfer/compat.py): one
sequence's contiguous run of pages attended in place, as the (page, slot, head, dim) pool
allows, against the (page, head, slot, dim) pool, in which a head slice of a page is one
contiguous read but a run of pages is no longer one (tokens, head, dim) view: its keys and
values are copied to (head, tokens, dim) first.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from radixserve.cache.page_allocator import PageAllocator
from radixserve.kernels.cpu import OPS as TORCH_SET
from radixserve.kernels.cpu.decode_attention import block_pages, forget_plan
from radixserve.kernels.cpu.decode_attention import decode_attention as fast
from radixserve.kernels.reference.decode_attention import decode_attention as reference

HEADS, KV_HEADS, HEAD_DIM, PAGE, LAYERS = 9, 3, 64, 16, 30
PROMPT_SHARE = 0.75  # of a mixed context, the part prefilled at once (contiguous)


def page_table(batch: int, pages: int, layout: str, gen: torch.Generator) -> torch.Tensor:
    """(B, pages) page ids >= 1 in a pool of 2 * B * pages + 1 pages."""
    if layout == "contiguous":
        return torch.arange(1, batch * pages + 1).view(batch, pages)
    if layout == "scattered":
        return (torch.randperm(2 * batch * pages, generator=gen)[: batch * pages] + 1).view(
            batch, pages
        )
    prompt = int(pages * PROMPT_SHARE)
    head = torch.arange(1, batch * prompt + 1).view(batch, prompt)
    grown = batch * prompt + 1 + torch.arange(batch * (pages - prompt)).view(-1, batch).T
    return torch.cat([head, grown], dim=1)  # decode pages interleave across sequences


def time_us(fn, args, budget_s: float) -> float:
    """Microseconds per layer, over whole steps of `LAYERS` calls."""
    fn(*args)
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < budget_s:
        fn(*args)
        reps += 1
    return (time.perf_counter() - start) / reps / LAYERS * 1e6


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def layouts(budget_s: float) -> None:
    """Microseconds per layer of one decode query over a contiguous run of pages, in the
    pool's layout and in the head-major one (see the module notes), batch 1, float32."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn((1, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM), generator=gen)

    def in_place(k: torch.Tensor, v: torch.Tensor) -> None:
        for _ in range(LAYERS):
            kt, vt = (x.view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)[None] for x in (k, v))
            _flash(q, kt, vt)

    def head_major(k: torch.Tensor, v: torch.Tensor) -> None:
        for _ in range(LAYERS):
            kt, vt = (x.transpose(0, 1).reshape(KV_HEADS, -1, HEAD_DIM)[None] for x in (k, v))
            _flash(q, kt, vt)

    print(f"{'ctx':>6} {'(P,S,H,D) us':>13} {'(P,H,S,D) us':>13} {'ratio':>6}")
    for ctx in (1024, 4096, 16384):
        k, v = (torch.randn((ctx // PAGE, PAGE, KV_HEADS, HEAD_DIM), generator=gen) for _ in "kv")
        hk, hv = (x.permute(0, 2, 1, 3).contiguous() for x in (k, v))
        ours = time_us(in_place, (k, v), budget_s)
        theirs = time_us(head_major, (hk, hv), budget_s)
        print(f"{ctx:>6} {ours:>13.0f} {theirs:>13.0f} {theirs / ours:>5.2f}x", flush=True)


def random_step(
    batch: int, ctx: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (B, H, D), a pool of 2 * B * pages + 1 pages for K and V, and lengths ctx - 5
    (the last page ends mid-page)."""
    shape = (2 * batch * (ctx // PAGE) + 1, PAGE, KV_HEADS, HEAD_DIM)
    k = torch.randn(shape, generator=gen).to(dtype)
    v = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen).to(dtype)
    return q, k, v, torch.full((batch,), ctx - 5)


def allocated_table(batch: int, pages: int, prompt: int, reserve: bool) -> torch.Tensor:
    """(B, pages) page ids as a `PageAllocator` hands them out: each prompt's `prompt`
    pages in one call, one sequence after another, then a page per sequence in turn; with
    `reserve`, each call for an owner reserving up to the end of its block (a whole next
    block when it ends one), as the scheduler asks."""
    allocator = PageAllocator(2 * batch * pages + 1)
    allocator.alloc(1)  # page 0, as in the other layouts
    per_block = block_pages(PAGE)

    def take(b: int, n: int, held: int) -> list[int]:
        spare = min(-(held + n) % per_block or per_block, pages - held - n)
        return allocator.alloc(n, owner=b, spare=spare) if reserve else allocator.alloc(n)

    table = [take(b, prompt, 0) for b in range(batch)]
    for held in range(prompt, pages):
        for b in range(batch):
            table[b] += take(b, 1, held)
    return torch.tensor(table)


def runs(budget_s: float) -> list[dict]:
    """Microseconds per layer of the CPU decodes on the allocator's page tables with and
    without reservations (see the module notes), float32 and bfloat16."""
    gen = torch.Generator().manual_seed(0)
    decodes = {"blocks": fast}  # this kernel: in place or gathered, block by block
    if TORCH_SET.decode_attention is not fast:  # the set's own (a native kernel) reads
        decodes["torch set"] = TORCH_SET.decode_attention  # through the page table
    rows = []
    print(f"{'decode':9} {'dtype':8} {'prompt':>6} {'B':>3} {'ctx':>5} {'no runs us':>10} "
          f"{'runs us':>9} {'ratio':>6}")  # fmt: skip
    for dtype in (torch.float32, torch.bfloat16):
        for share in (0.25, 0.75):
            for batch in (4, 16):
                for ctx in (1024, 4096):
                    calls = _runs_calls(dtype, share, batch, ctx, gen)
                    for name, decode in decodes.items():
                        rows.append(_time_runs(name, decode, calls, budget_s))
    return rows


def _runs_calls(
    dtype: torch.dtype, share: float, batch: int, ctx: int, gen: torch.Generator
) -> tuple[tuple, tuple, dict]:
    """The same tokens laid out without and with reservations, and the cell's labels."""
    pages = ctx // PAGE
    q, k, v, lens = random_step(batch, ctx, dtype, gen)
    prompt = int(pages * share)
    plain = (q, k, v, allocated_table(batch, pages, prompt, reserve=False), lens)
    ran = _moved(plain, allocated_table(batch, pages, prompt, reserve=True))
    labels = dict(dtype=str(dtype).removeprefix("torch."), prompt_share=share, batch=batch,
                  ctx=ctx)  # fmt: skip
    return plain, ran, labels


def _time_runs(name: str, decode, calls: tuple[tuple, tuple, dict], budget_s: float) -> dict:
    """One cell of `runs`; the two layouts must give the same bits."""
    plain, ran, labels = calls
    forget_plan()
    if not torch.equal(decode(*plain), decode(*ran)):
        raise AssertionError(f"{name}: the decode differs with runs")
    off, on = alternating_us([(decode, plain), (decode, ran)], budget_s)
    row = dict(decode=name, **labels, no_runs_us=off, runs_us=on, ratio=off / on)
    print(f"{name:9} {row['dtype']:8} {row['prompt_share']:>6.0%} {row['batch']:>3} "
          f"{row['ctx']:>5} {off:>10.0f} {on:>9.0f} {off / on:>5.2f}x", flush=True)  # fmt: skip
    return row


def alternating_us(runs: list[tuple], budget_s: float) -> list[float]:
    """Microseconds per layer of whole steps, (decode, call) each, the steps of the runs
    alternating (so a busy machine slows them alike): the median of each."""
    times: list[list[float]] = [[] for _ in runs]
    start = time.perf_counter()
    while time.perf_counter() - start < len(runs) * budget_s or len(times[0]) < 3:
        for (decode, call), out in zip(runs, times):
            t0 = time.perf_counter()
            forget_plan()  # each step plans once, for all its layers
            for _ in range(LAYERS):
                decode(*call)
            out.append((time.perf_counter() - t0) / LAYERS * 1e6)
    return [statistics.median(t) for t in times]


def _moved(call: tuple, table: torch.Tensor) -> tuple:
    """`call` with its tokens moved to the pages of `table` (B, W) in a fresh pool."""
    q, k, v, old_table, lens = call
    k2, v2 = torch.full_like(k, float("nan")), torch.full_like(v, float("nan"))
    k2[table.flatten()] = k[old_table.flatten()]
    v2[table.flatten()] = v[old_table.flatten()]
    return q, k2, v2, table, lens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing per cell and op")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--layouts", action="store_true", help="time the pool layouts instead")
    parser.add_argument("--runs", action="store_true", help="time with and without runs")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layouts:
        layouts(args.budget_s)
        return
    if args.runs:
        result = runs(args.budget_s)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"threads": args.threads, "rows": result}, f, indent=1)
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'dtype':8} {'layout':10} {'B':>3} {'ctx':>5} {'ref us':>9} {'new us':>9} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("contiguous", "mixed", "scattered"):
            for batch in (1, 4, 16):
                for ctx in (256, 1024, 4096):
                    q, k, v, lens = random_step(batch, ctx, dtype, gen)
                    call = (q, k, v, page_table(batch, ctx // PAGE, layout, gen), lens)
                    forget_plan()
                    torch.testing.assert_close(fast(*call), reference(*call), atol=3e-2, rtol=3e-2)
                    ref_us, new_us = alternating_us(
                        [(reference, call), (fast, call)], args.budget_s
                    )
                    row = dict(dtype=str(dtype).removeprefix("torch."), layout=layout,
                               batch=batch, ctx=ctx, ref_us=ref_us, new_us=new_us,
                               ratio=ref_us / new_us)  # fmt: skip
                    rows.append(row)
                    print(f"{row['dtype']:8} {layout:10} {batch:>3} {ctx:>5} {ref_us:>9.0f} "
                          f"{new_us:>9.0f} {row['ratio']:>5.2f}x", flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"threads": args.threads, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
