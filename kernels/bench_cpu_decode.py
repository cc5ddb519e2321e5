"""Decode attention on CPU: `cpu.decode_attention` against the torch reference, in one run.

SmolLM2-135M's attention shapes (9 q heads, 3 kv heads, head_dim 64, page size 16), batch
1/4/16, contexts 256/1024/4096, float32 and bfloat16, with each sequence's pages laid out
three ways: contiguous (one run), scattered (every page alone) and mixed (a contiguous
prompt, then one page in every `batch` as concurrent decodes grow). Times whole steps (30
layers, one plan each) and prints one table of microseconds per layer and the ratio
reference / new; `--json` writes the rows.

    .venv/bin/python kernels/bench_cpu_decode.py [--threads N] [--json out.json]

``--layouts`` instead times the choice of pool layout (radixserve/transfer/compat.py): one
sequence's contiguous run of pages attended in place, as the (page, slot, head, dim) pool
allows, against the (page, head, slot, dim) pool, in which a head slice of a page is one
contiguous read but a run of pages is no longer one (tokens, head, dim) view: its keys and
values are copied to (head, tokens, dim) first.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from radixserve.kernels.cpu.decode_attention import decode_attention as fast
from radixserve.kernels.cpu.decode_attention import forget_plan
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


def step_reference(*call: torch.Tensor) -> None:
    for _ in range(LAYERS):
        reference(*call)


def step_fast(*call: torch.Tensor) -> None:
    forget_plan()  # each step plans once, for all its layers
    for _ in range(LAYERS):
        fast(*call)


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--budget-s", type=float, default=0.3, help="timing per cell and op")
    parser.add_argument("--json", default=None, help="write the rows here")
    parser.add_argument("--layouts", action="store_true", help="time the pool layouts instead")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.layouts:
        layouts(args.budget_s)
        return
    gen = torch.Generator().manual_seed(0)
    rows = []
    print(f"{'dtype':8} {'layout':10} {'B':>3} {'ctx':>5} {'ref us':>9} {'new us':>9} {'ratio':>6}")
    for dtype in (torch.float32, torch.bfloat16):
        for layout in ("contiguous", "mixed", "scattered"):
            for batch in (1, 4, 16):
                for ctx in (256, 1024, 4096):
                    pages = ctx // PAGE
                    shape = (2 * batch * pages + 1, PAGE, KV_HEADS, HEAD_DIM)
                    k = torch.randn(shape, generator=gen).to(dtype)
                    v = torch.randn(shape, generator=gen).to(dtype)
                    q = torch.randn((batch, HEADS, HEAD_DIM), generator=gen).to(dtype)
                    lens = torch.full((batch,), ctx - 5)  # the last page ends mid-page
                    call = (q, k, v, page_table(batch, pages, layout, gen), lens)
                    forget_plan()
                    torch.testing.assert_close(fast(*call), reference(*call), atol=3e-2, rtol=3e-2)
                    ref_us = time_us(step_reference, call, args.budget_s)
                    new_us = time_us(step_fast, call, args.budget_s)
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
