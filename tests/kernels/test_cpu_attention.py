"""The native CPU attention (`kernels/cpu/attention.py`): against the reference on poisoned
pools (extend over cached prefixes, decode with padding rows, sliding windows, page sizes,
GQA, float32 and bfloat16), and batch-invariant: a row's output is the same bits from a
full prefill, a cached-prefix extend at any split, a decode step, among other sequences,
with its pages anywhere in the pool, on any number of threads. Skipped where no C
compiler is (the torch set then runs the reference extend and `cpu/decode_attention.py`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from radixserve.kernels import reference
from radixserve.kernels.cpu import attention as cpu_attention
from radixserve.kernels.cpu.attention import decode_attention, extend_attention, native_attention

TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True, scope="module")
def kernel() -> None:
    if native_attention() is None:
        pytest.skip("no C compiler here: no native attention (the reference paths run)")


@pytest.fixture
def threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


class Pool:
    """One layer's K/V pool (NaN everywhere no sequence owns) and sequences' pages."""

    def __init__(self, lengths: list[int], page_size: int, kv_heads: int, dim: int,
                 dtype: torch.dtype, seed: int = 0) -> None:  # fmt: skip
        g = torch.Generator().manual_seed(seed)
        pages = [-(-n // page_size) for n in lengths]
        total = 2 * sum(pages) + 3
        self.k = torch.full((total, page_size, kv_heads, dim), float("nan"), dtype=dtype)
        self.v = torch.full_like(self.k, float("nan"))
        order = torch.randperm(total - 1, generator=g) + 1  # scattered; page 0 never used
        width = max(pages)
        self.table = torch.zeros(len(lengths), width, dtype=torch.int64)
        used = 0
        for b, (n, count) in enumerate(zip(lengths, pages)):
            self.table[b, :count] = order[used : used + count]
            used += count
            for j in range(n):
                page, slot = self.table[b, j // page_size], j % page_size
                self.k[page, slot] = torch.randn(kv_heads, dim, generator=g).to(dtype)
                self.v[page, slot] = torch.randn(kv_heads, dim, generator=g).to(dtype)
        self.lengths = lengths


def _extend(pool: Pool, q: torch.Tensor, prefixes: list[int], news: list[int], **kw):
    cu = torch.tensor([0, *torch.tensor(news).cumsum(0).tolist()])
    args = (q, pool.k, pool.v, cu, torch.tensor(prefixes), pool.table, max(news))
    return extend_attention(*args, **kw), reference.extend_attention(*args, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "page_size,heads,kv_heads,dim", [(16, 9, 3, 64), (1, 8, 8, 32), (64, 8, 1, 128), (4, 6, 3, 80)]
)
@pytest.mark.parametrize("window", [0, 1, 20])
def test_matches_the_reference(dtype, page_size, heads, kv_heads, dim, window):
    lengths = [1, 17, 40, 64]  # one token, mid-page, several pages, a page exactly
    pool = Pool(lengths, page_size, kv_heads, dim, dtype)
    prefixes, news = [0, 5, 16, 63], [1, 12, 24, 1]
    q = torch.randn(sum(news), heads, dim).to(dtype)
    ours, ref = _extend(pool, q, prefixes, news, window=window, scale=0.3)
    assert not torch.isnan(ours).any()  # nothing past a sequence's tokens was read
    torch.testing.assert_close(ours, ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    seq_lens = torch.tensor([*lengths, 0])  # and a padding row
    table = torch.cat((pool.table, pool.table[:1]))
    qd = torch.randn(5, heads, dim).to(dtype)
    ours = decode_attention(qd, pool.k, pool.v, table, seq_lens, window=window)
    ref = reference.decode_attention(qd, pool.k, pool.v, table, seq_lens, window=window)
    torch.testing.assert_close(ours, ref, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])
    assert (ours[4] == 0).all()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [0, 21])
def test_a_row_is_the_same_bits_however_it_is_computed(dtype, window, threads, monkeypatch):
    """Every row of a 70-token sequence, from the full prefill, from extends over cached
    prefixes of 1, 15, 16, 17 and 69 tokens (among another sequence's rows), from decode
    steps (alone and beside other sequences), with the pages laid out another way, on 1,
    2 and 3 threads split down to single items, each item one kv head, all of them, or a
    part of the q heads (-n: n contiguous parts; at -3 heads 2 and 3, of two kv heads,
    are one part): the same bits."""
    monkeypatch.setattr(cpu_attention, "_SPLIT_WORK", 0)
    kernel = native_attention()
    assert kernel is not None
    n, heads, kv_heads, dim = 70, 6, 2, 64
    pool = Pool([n, 50], 16, kv_heads, dim, dtype, seed=1)
    q = torch.randn(n, heads, dim).to(dtype)
    other = torch.randn(30, heads, dim).to(dtype)
    torch.set_num_threads(1)
    full, _ = _extend(pool, q, [0], [n], window=window)
    expected = _bits(full)
    for num_threads, item_heads in [(t, h) for t in (1, 2, 3) for h in (1, kv_heads, -3, -4)]:
        torch.set_num_threads(num_threads)
        monkeypatch.setattr(kernel, "item_heads", item_heads)
        for split in (1, 15, 16, 17, n - 1):  # this sequence's rows beside another's
            out, _ = _extend(pool, torch.cat((q[split:], other)), [split, 20], [n - split, 30],
                             window=window)  # fmt: skip
            assert torch.equal(_bits(out[: n - split]), expected[split:]), (split, item_heads)
        for pos in (0, 15, 16, 40, n - 1):  # a decode step, alone and beside the other
            seq_lens = torch.tensor([pos + 1, 50])
            qd = torch.stack((q[pos], other[0]))
            out = decode_attention(qd, pool.k, pool.v, pool.table, seq_lens, window=window)
            assert torch.equal(_bits(out[0]), expected[pos]), (pos, item_heads)
            alone = decode_attention(q[pos : pos + 1], pool.k, pool.v, pool.table[:1],
                                     torch.tensor([pos + 1]), window=window)  # fmt: skip
            assert torch.equal(_bits(alone[0]), expected[pos])
    moved = Pool([n, 50], 16, kv_heads, dim, dtype, seed=1)  # the same tokens ...
    pages = moved.table.clone()
    remap = torch.randperm(moved.k.shape[0] - 1, generator=torch.Generator().manual_seed(9)) + 1
    moved.k[remap], moved.v[remap] = moved.k[1:].clone(), moved.v[1:].clone()
    moved.table = torch.where(pages > 0, remap[(pages - 1).clamp(min=0)], 0)  # ... elsewhere
    out, _ = _extend(moved, q, [0], [n], window=window)
    assert torch.equal(_bits(out), expected)
