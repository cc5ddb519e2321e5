"""The CPU decode attention of the torch set against the reference, on pools poisoned
with NaN outside what each sequence owns: pages in one run each (read in place), scattered
(gathered), and long runs broken by lone pages (both, merged by log-sum-exp); ragged
lengths (1, mid-page, whole pages, a padding row), GQA, float32 and bfloat16. Sliding
windows and a non-default scale against the reference and a dense masked softmax, with
the pages wholly before each window poisoned too."""

from __future__ import annotations

import importlib

import pytest
import torch

from radixserve.kernels import reference as ref
from tests.kernels.paged import (
    PagedBatch,
    assert_close,
    assert_close_to_dense,
    dense_attention,
    index,
    make_paged_batch,
    randn,
)

cpu = importlib.import_module("radixserve.kernels.cpu.decode_attention")
CPU = torch.device("cpu")
PAGE = 4


def _relaid(batch: PagedBatch, tables: list[list[int]]) -> PagedBatch:
    """The same tokens moved to the pages `tables[b]` of a fresh NaN pool."""
    ps = batch.page_size
    num_pages = max(p for t in tables for p in t) + 2
    k = torch.full((num_pages, *batch.k_cache.shape[1:]), float("nan"), dtype=batch.k_cache.dtype)
    v = k.clone()
    width = max(len(t) for t in tables)
    table = torch.zeros((len(tables), max(width, 1)), dtype=torch.int64)
    for b, (n, pages) in enumerate(zip(batch.seq_lens, tables)):
        table[b, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
        for pos in range(n):
            src = batch.slot(b, pos)
            k[pages[pos // ps], pos % ps] = batch.k_cache.flatten(0, 1)[src]
            v[pages[pos // ps], pos % ps] = batch.v_cache.flatten(0, 1)[src]
    return PagedBatch(k, v, table, batch.seq_lens)


def _tables(seq_lens: list[int], layout: str) -> list[list[int]]:
    """Page ids per sequence: "contiguous" one run each; "broken" a run, a lone page
    taken from a shared tail, then a run to the end, with the last page lone when there
    are only a few pages."""
    counts = [-(-n // PAGE) for n in seq_lens]
    next_id, lone = 1, 1000
    tables = []
    for c in counts:
        if layout == "contiguous" or c < 3:
            pages = list(range(next_id, next_id + c))
        else:
            mid = c // 2
            pages = (
                list(range(next_id, next_id + mid))
                + [lone]
                + list(range(next_id + mid + 1, next_id + c))
            )
            lone += 2  # lone pages interleave with other sequences'
        next_id += c + 1  # a spare page between sequences
        tables.append(pages)
    return tables


SEQ_LENS = [1, PAGE + 3, 3 * PAGE, 0, 11 * PAGE + 2, 9 * PAGE, 2]  # 0: a padding row


@pytest.mark.parametrize("layout", ["scattered", "contiguous", "broken"])
@pytest.mark.parametrize(
    "dtype,group", [(torch.float32, 3), (torch.bfloat16, 1), (torch.float32, 8)]
)
def test_cpu_decode_equals_reference(monkeypatch, layout, dtype, group):
    monkeypatch.setattr(cpu, "BLOCK_TOKENS", 3 * PAGE)  # short blocks: every path, and merges
    cpu.forget_plan()
    batch = make_paged_batch(SEQ_LENS, PAGE, 2, 8, dtype, CPU, seed=3)
    if layout != "scattered":
        batch = _relaid(batch, _tables(SEQ_LENS, layout))
    q = randn((len(SEQ_LENS), 2 * group, 8), dtype, CPU, seed=4)
    call = (q, batch.k_cache, batch.v_cache, batch.page_table, index(SEQ_LENS, CPU))
    out = cpu.decode_attention(*call)
    assert_close(out, ref.decode_attention(*call))
    assert not out[3].any()  # the padding row


@pytest.mark.parametrize("layout", ["scattered", "contiguous", "broken"])
@pytest.mark.parametrize(
    "window,scale,dtype",
    [
        pytest.param(1, None, torch.float32, id="window1"),
        pytest.param(5, 0.2, torch.bfloat16, id="window5-scale-bfloat16"),
        pytest.param(29, None, torch.float32, id="window29"),  # a view cut at its start
        pytest.param(1000, None, torch.float32, id="window-past-the-end"),
    ],
)
def test_cpu_decode_with_a_window(monkeypatch, layout, window, scale, dtype):
    """Windows of 1, not a multiple of the page, cutting a run or a gathered page at its
    start, and longer than every sequence (the same as none); pages wholly before a
    window hold NaN."""
    monkeypatch.setattr(cpu, "BLOCK_TOKENS", 3 * PAGE)
    cpu.forget_plan()
    batch = make_paged_batch(SEQ_LENS, PAGE, 2, 8, dtype, CPU, seed=7)
    if layout != "scattered":
        batch = _relaid(batch, _tables(SEQ_LENS, layout))
    for b, n in enumerate(SEQ_LENS):
        before = [batch.slot(b, j) for j in range(max(0, n - window) // PAGE * PAGE)]
        batch.k_cache.flatten(0, 1)[before] = float("nan")
        batch.v_cache.flatten(0, 1)[before] = float("nan")
    q = randn((len(SEQ_LENS), 6, 8), dtype, CPU, seed=8)
    call = (q, batch.k_cache, batch.v_cache, batch.page_table, index(SEQ_LENS, CPU))
    out = cpu.decode_attention(*call, window=window, scale=scale)
    assert_close(out, ref.decode_attention(*call, window=window, scale=scale))
    for b, n in enumerate(SEQ_LENS):
        if n:
            dense = dense_attention(q[b : b + 1], batch, b, [n - 1], window, scale)
            assert_close_to_dense(out[b : b + 1], dense)
    assert not out[3].any()  # the padding row
    if window >= max(SEQ_LENS):
        assert_close(out, cpu.decode_attention(*call, scale=scale))


def test_local_and_global_layers_keep_a_plan_each(monkeypatch):
    """Alternating windows (a model's local and global layers) plan once per window, and
    a plan serves only its own window."""
    monkeypatch.setattr(cpu, "BLOCK_TOKENS", 3 * PAGE)
    cpu.forget_plan()
    made = []  # the window of each plan made
    make = cpu._make_plan

    def counted(*args):
        made.append(args[-1])
        return make(*args)

    monkeypatch.setattr(cpu, "_make_plan", counted)
    batch = _relaid(make_paged_batch(SEQ_LENS, PAGE, 2, 8, torch.float32, CPU, seed=9),
                    _tables(SEQ_LENS, "broken"))  # fmt: skip
    q = randn((len(SEQ_LENS), 2, 8), torch.float32, CPU, seed=10)
    call = (q, batch.k_cache, batch.v_cache, batch.page_table, index(SEQ_LENS, CPU))
    for window in (0, 13, 0, 13):
        out = cpu.decode_attention(*call, window=window)
        assert_close(out, ref.decode_attention(*call, window=window))
    assert made == [0, 13]


def test_plan_follows_the_page_table_and_lengths():
    # The plan kept from one call must not serve a call whose pages or lengths differ.
    cpu.forget_plan()
    seq_lens = [40 * PAGE + 1, 17 * PAGE]
    base = make_paged_batch(seq_lens, PAGE, 2, 8, torch.float32, CPU, seed=5)
    q = randn((2, 6, 8), torch.float32, CPU, seed=6)
    for batch in (_relaid(base, _tables(seq_lens, "contiguous")), base):
        for lens in (seq_lens, [n - 1 for n in seq_lens]):
            call = (q, batch.k_cache, batch.v_cache, batch.page_table, index(lens, CPU))
            assert_close(cpu.decode_attention(*call), ref.decode_attention(*call))


def test_torch_set_takes_the_native_attention_and_falls_back_to_this_decode():
    from radixserve.kernels.cpu import attention
    from radixserve.kernels.ops import load_ops

    # the native batch-invariant kernel serves extend and decode alike; this decode is
    # what it falls back to where the native library is not built
    assert load_ops("torch").decode_attention is attention.decode_attention
    assert load_ops("torch").extend_attention is attention.extend_attention
    assert attention.gathered_decode is cpu.decode_attention


# -- the same bits wherever the pages lie ------------------------------------------------

LONG_PAGE = 16  # the default page size: blocks of 16 pages (256 tokens)
LONG_LENS = [700, 256, 1, 513, 300]  # full blocks and edges, a whole block, one token


def _layouts(batch: PagedBatch) -> dict[str, PagedBatch]:
    """The same tokens in one run per sequence (every full block read in place), with
    pages interleaved across sequences as one-at-a-time decodes leave them (every block
    gathered), and shuffled (`make_paged_batch`'s own)."""
    counts = [-(-n // LONG_PAGE) for n in batch.seq_lens]
    starts = [1 + sum(counts[:b]) for b in range(len(counts))]
    runs = [list(range(s, s + c)) for s, c in zip(starts, counts)]
    rows = len(counts)
    interleaved = [[1 + b + i * rows for i in range(c)] for b, c in enumerate(counts)]
    return {"runs": _relaid(batch, runs), "interleaved": _relaid(batch, interleaved),
            "shuffled": batch}  # fmt: skip


def _decode(batch: PagedBatch, q: torch.Tensor, window: int = 0) -> torch.Tensor:
    cpu.forget_plan()
    lens = index(batch.seq_lens, CPU)
    return cpu.decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, lens,
                                window=window)  # fmt: skip


@pytest.mark.parametrize("window", [0, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_is_the_same_bits_in_place_or_gathered(dtype, window):
    """Runs read in place, and the same tokens gathered from interleaved or shuffled
    pages, give the same output bit for bit (GQA 3: a float32 case where an unaligned
    per-thread buffer would round differently), and that output is the reference's."""
    base = make_paged_batch(LONG_LENS, LONG_PAGE, 3, 64, dtype, CPU, seed=11)
    q = randn((len(LONG_LENS), 9, 64), dtype, CPU, seed=12)
    outs = {}
    for name, batch in _layouts(base).items():
        outs[name] = _decode(batch, q, window)
        plan = cpu._last[window]
        assert bool(plan.views) == (name == "runs"), name  # in place only where runs are
        assert (plan.gather_rows is None) == (name == "runs"), name
    assert torch.equal(outs["runs"], outs["interleaved"])
    assert torch.equal(outs["runs"], outs["shuffled"])
    batch = _layouts(base)["runs"]
    call = (q, batch.k_cache, batch.v_cache, batch.page_table, index(LONG_LENS, CPU))
    assert_close(outs["runs"], ref.decode_attention(*call, window=window))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_is_the_same_bits_alone_or_batched_and_at_any_thread_count(dtype):
    """A sequence's output does not depend on the other sequences of its batch, nor on
    the number of threads."""
    batch = _layouts(make_paged_batch(LONG_LENS, LONG_PAGE, 3, 64, dtype, CPU, seed=13))["runs"]
    q = randn((len(LONG_LENS), 9, 64), dtype, CPU, seed=14)
    together = _decode(batch, q)
    for b in range(len(LONG_LENS)):
        alone = PagedBatch(batch.k_cache, batch.v_cache, batch.page_table[b : b + 1],
                           batch.seq_lens[b : b + 1])  # fmt: skip
        assert torch.equal(_decode(alone, q[b : b + 1]), together[b : b + 1]), b
    threads = torch.get_num_threads()
    try:
        for count in {1, 2, threads}:
            torch.set_num_threads(count)
            assert torch.equal(_decode(batch, q), together), count
    finally:
        torch.set_num_threads(threads)
