"""Ragged paged batches for kernel tests, on a pool poisoned with NaN everywhere a
sequence's tokens are not, so a kernel that reads or writes out of bounds fails.

Tolerances (kernel vs reference, absolute and relative alike):
  float32   2e-5   accumulation order only
  float16   4e-3   a few float16 roundings (2^-11 each) of P and the output
  bfloat16  3e-2   bfloat16 roundings (2^-8 each); and Triton's interpreter (3.9) casts
                   float32 to bfloat16 by truncation, not round-to-nearest, so on CPU an
                   output can sit one more bfloat16 step (2^-7) from torch's
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype
    assert not torch.isnan(expected).any(), "the reference read a poisoned slot"
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


@dataclass
class PagedBatch:
    """Sequences b = 0..B-1 of `seq_lens[b]` tokens in pages `page_table[b]` of a pool."""

    k_cache: torch.Tensor  # (num_pages, page_size, H_kv, D)
    v_cache: torch.Tensor
    page_table: torch.Tensor  # (B, W) int64, zero-padded
    seq_lens: list[int]

    @property
    def page_size(self) -> int:
        return self.k_cache.shape[1]

    def slot(self, b: int, pos: int) -> int:
        ps = self.page_size
        return int(self.page_table[b, pos // ps]) * ps + pos % ps


def make_paged_batch(
    seq_lens: list[int],
    page_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
) -> PagedBatch:
    """Random K/V for every sequence token, in shuffled pages with spare pages between;
    every other slot (spare pages, page 0, tails past a sequence's end) holds NaN."""
    gen = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in seq_lens]
    num_pages = 2 * sum(pages_per_seq) + 2
    ids = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 never owned
    width = max(pages_per_seq + [1])
    table = torch.zeros((len(seq_lens), width), dtype=torch.int64)
    shape = (num_pages, page_size, num_kv_heads, head_dim)
    k = torch.full(shape, float("nan"))
    v = torch.full(shape, float("nan"))
    for b, (n, np_) in enumerate(zip(seq_lens, pages_per_seq)):
        table[b, :np_] = torch.tensor([ids.pop() for _ in range(np_)], dtype=torch.int64)
        for pos in range(n):
            page, off = int(table[b, pos // page_size]), pos % page_size
            k[page, off] = torch.randn((num_kv_heads, head_dim), generator=gen)
            v[page, off] = torch.randn((num_kv_heads, head_dim), generator=gen)
    return PagedBatch(
        k.to(dtype).to(device), v.to(dtype).to(device), table.to(device), list(seq_lens)
    )


def dense_attention(
    q: torch.Tensor,
    batch: PagedBatch,
    b: int,
    positions: list[int],
    window: int = 0,
    scale: float | None = None,
) -> torch.Tensor:
    """Queries q (n, H, D) of sequence b at `positions`, by one dense masked softmax in
    float64 on CPU (n, H, D): the query at p sees key j iff j <= p and, with a window w,
    j > p - w. Independent of the kernels: reads token by token through `batch.slot`, only
    the keys some query sees."""
    heads, dim = q.shape[1:]
    keys = range(max(0, min(positions) - window + 1) if window else 0, max(positions) + 1)
    slots = [batch.slot(b, j) for j in keys]
    group = heads // batch.k_cache.shape[2]
    k = batch.k_cache.flatten(0, 1)[slots].cpu().double().repeat_interleave(group, 1)  # (S, H, D)
    v = batch.v_cache.flatten(0, 1)[slots].cpu().double().repeat_interleave(group, 1)
    scores = torch.einsum("nhd,shd->hns", q.cpu().double(), k)
    scores *= dim**-0.5 if scale is None else scale
    key = torch.tensor(list(keys))[None, :]
    query = torch.tensor(positions)[:, None]
    seen = key <= query  # (n, S)
    if window:
        seen &= key > query - window
    weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)  # (H, n, S)
    return torch.einsum("hns,shd->nhd", weights, v)


def assert_close_to_dense(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """A kernel's output against `dense_attention`'s float64, at the kernel dtype's tolerance."""
    tol = TOLERANCE[actual.dtype]
    torch.testing.assert_close(actual.cpu().double(), expected, atol=tol, rtol=tol)


def randn(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def index(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=device)
