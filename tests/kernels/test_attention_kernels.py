"""Triton extend and decode attention against the reference, on poisoned pools.

Every page size (1, 16, 64), GQA ratio (1, 3, 8) and dtype appears, each pair of them
together once (a Latin square: nine cases, not 27). Each case is a ragged batch with a
length-1 sequence and lengths that end mid-page. Sliding windows and a non-default scale
are checked, both sets, against a dense masked softmax (`paged.dense_attention`) too.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import reference as ref
from tests.kernels.conftest import TRITON
from tests.kernels.paged import (
    assert_close,
    assert_close_to_dense,
    dense_attention,
    index,
    make_paged_batch,
    randn,
)

F32, BF16, F16 = torch.float32, torch.bfloat16, torch.float16
# (page_size, q heads per kv head, dtype, kv heads)
_SQUARE = [
    (1, 1, F32, 2), (16, 3, BF16, 2), (64, 8, F16, 1),
    (16, 1, F16, 2), (64, 3, F32, 1), (1, 8, BF16, 1),
    (64, 1, BF16, 2), (1, 3, F16, 1), (16, 8, F32, 1),
]  # fmt: skip
CASES = [
    pytest.param(*case, id=f"page{case[0]}-gqa{case[1]}-{str(case[2]).removeprefix('torch.')}")
    for case in _SQUARE
]
HEAD_DIM = 16


def _spans(page_size: int) -> list[tuple[int, int]]:
    """(prefix, new tokens): no prefix; a prefix ending mid-page; one new token; a run
    that crosses pages and ends mid-page."""
    return [(0, 7), (page_size + 3, 5), (6, 1), (page_size, min(page_size, 16) + 3)]


@pytest.mark.parametrize("page_size,group,dtype,kv_heads", CASES)
def test_extend_attention_matches_reference(device, page_size, group, dtype, kv_heads):
    spans = _spans(page_size)
    seq_lens = [p + n for p, n in spans]
    batch = make_paged_batch(seq_lens, page_size, kv_heads, HEAD_DIM, dtype, device, seed=3)
    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    q = randn((cu[-1], kv_heads * group, HEAD_DIM), dtype, device, seed=4)
    args = (
        q, batch.k_cache, batch.v_cache, index(cu, device),
        index([p for p, _ in spans], device), batch.page_table, max(n for _, n in spans),
    )  # fmt: skip
    assert_close(TRITON.extend_attention(*args), ref.extend_attention(*args))


@pytest.mark.parametrize(
    "page_size,group,dtype,kv_heads,num_splits",
    [pytest.param(*c.values, (1, 3, 8)[i % 3], id=c.id) for i, c in enumerate(CASES)],
)
def test_decode_attention_matches_reference(device, page_size, group, dtype, kv_heads, num_splits):
    """Split-K with 1, 3 and 8 splits (8 leaves some splits of the short rows empty)."""
    # length 1, mid-page, exactly a page, several pages, and a padding row (0)
    seq_lens = [1, page_size + 5, page_size, 2 * page_size + 7, 0]
    batch = make_paged_batch(seq_lens, page_size, kv_heads, HEAD_DIM, dtype, device, seed=5)
    q = randn((len(seq_lens), kv_heads * group, HEAD_DIM), dtype, device, seed=6)
    lens = index(seq_lens, device)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, lens)
    assert_close(TRITON.decode_attention(*args, num_splits), ref.decode_attention(*args))


def test_head_dim_that_is_not_a_power_of_two(device):
    batch = make_paged_batch([9, 21], 4, 2, 24, F32, device, seed=7)
    q = randn((2, 4, 24), F32, device, seed=8)
    lens = index([9, 21], device)
    assert_close(
        TRITON.decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, lens, 2),
        ref.decode_attention(q, batch.k_cache, batch.v_cache, batch.page_table, lens),
    )
    args = (q, batch.k_cache, batch.v_cache, index([0, 1, 2], device), index([8, 20], device),
            batch.page_table, 1)  # fmt: skip
    assert_close(TRITON.extend_attention(*args), ref.extend_attention(*args))


@pytest.mark.parametrize("dtype", [F32, BF16], ids=["float32", "bfloat16"])
def test_extend_attention_over_several_query_blocks(device, dtype):
    """Runs longer than one 128-row query block: later blocks see earlier blocks' tokens
    unmasked and their own causally."""
    spans = [(10, 150), (0, 131), (40, 3)]
    batch = make_paged_batch([p + n for p, n in spans], 16, 1, HEAD_DIM, dtype, device, seed=9)
    cu = [0, 150, 281, 284]
    q = randn((cu[-1], 3, HEAD_DIM), dtype, device, seed=10)
    args = (q, batch.k_cache, batch.v_cache, index(cu, device),
            index([p for p, _ in spans], device), batch.page_table, 150)  # fmt: skip
    assert_close(TRITON.extend_attention(*args), ref.extend_attention(*args))


# (page_size, q heads per kv head, dtype, window, scale): a window not a multiple of the
# page and shorter than the long prefix (whose first block the kernel skips); a window of
# 1 (itself only); page size 1 with a non-default scale; a window longer than every
# sequence (the same as none); no window with a non-default scale
_WINDOWS = [
    pytest.param(4, 3, F32, 5, None, id="page4-window5"),
    pytest.param(16, 1, BF16, 1, None, id="page16-window1-bfloat16"),
    pytest.param(1, 8, F16, 7, 0.3, id="page1-window7-scale-float16"),
    pytest.param(16, 3, F32, 1000, None, id="page16-window-past-the-end"),
    pytest.param(64, 1, F32, 0, 0.05, id="page64-global-scale"),
]
# (prefix, new tokens): no prefix, longer than the window; a cached prefix longer than
# the window and past one key block; one new token; a run longer than the window
_WINDOW_SPANS = [(0, 9), (70, 6), (6, 1), (13, 20)]


def _extend_both_sets(q, batch, spans, device, window, scale):
    """Triton and the reference on `spans`, each checked against the dense softmax and
    Triton against the reference; returns Triton's output and the call's arguments."""
    cu = [0]
    for _, n in spans:
        cu.append(cu[-1] + n)
    prefix_lens = index([p for p, _ in spans], device)
    args = (q, batch.k_cache, batch.v_cache, index(cu, device), prefix_lens, batch.page_table,
            max(n for _, n in spans))  # fmt: skip
    got = TRITON.extend_attention(*args, window=window, scale=scale)
    want = ref.extend_attention(*args, window=window, scale=scale)
    for b, (prefix, n) in enumerate(spans):
        rows = slice(cu[b], cu[b + 1])
        dense = dense_attention(q[rows], batch, b, list(range(prefix, prefix + n)), window, scale)
        assert_close_to_dense(want[rows], dense)
        assert_close_to_dense(got[rows], dense)
    assert_close(got, want)
    return got, args


@pytest.mark.parametrize("page_size,group,dtype,window,scale", _WINDOWS)
def test_extend_attention_sliding_window_and_scale(device, page_size, group, dtype, window, scale):
    seq_lens = [p + n for p, n in _WINDOW_SPANS]
    batch = make_paged_batch(seq_lens, page_size, 1, HEAD_DIM, dtype, device, seed=11)
    q = randn((sum(n for _, n in _WINDOW_SPANS), group, HEAD_DIM), dtype, device, seed=12)
    got, args = _extend_both_sets(q, batch, _WINDOW_SPANS, device, window, scale)
    if window >= max(seq_lens):
        assert_close(got, TRITON.extend_attention(*args, scale=scale))


def test_extend_attention_window_over_several_query_blocks(device):
    """128-row query blocks with a window shorter than a 64-key block: rows that see no
    key of a block before their window, and a later block's prefix masked per row."""
    spans = [(10, 150), (0, 131), (100, 3)]
    batch = make_paged_batch([p + n for p, n in spans], 16, 1, HEAD_DIM, F32, device, seed=13)
    q = randn((284, 2, HEAD_DIM), F32, device, seed=14)
    _extend_both_sets(q, batch, spans, device, 20, None)


@pytest.mark.parametrize("page_size,group,dtype,window,scale", _WINDOWS)
def test_decode_attention_sliding_window_and_scale(device, page_size, group, dtype, window, scale):
    """Split-K over the window: lengths 1, shorter and longer than the window, a padding
    row (0); 3 splits, so some splits of short windows are empty."""
    seq_lens = [1, 70, 16, 39, 0, 5]
    batch = make_paged_batch(seq_lens, page_size, 1, HEAD_DIM, dtype, device, seed=15)
    q = randn((len(seq_lens), group, HEAD_DIM), dtype, device, seed=16)
    args = (q, batch.k_cache, batch.v_cache, batch.page_table, index(seq_lens, device))
    got = TRITON.decode_attention(*args, 3, window=window, scale=scale)
    want = ref.decode_attention(*args, window=window, scale=scale)
    assert_close(got, want)
    for b, n in enumerate(seq_lens):
        if not n:
            assert not got[b].any() and not want[b].any()
            continue
        dense = dense_attention(q[b : b + 1], batch, b, [n - 1], window, scale)
        assert_close_to_dense(want[b : b + 1], dense)
        assert_close_to_dense(got[b : b + 1], dense)
    if window >= max(seq_lens):
        assert_close(got, TRITON.decode_attention(*args, 3, scale=scale))


def test_keys_wholly_before_the_window_are_not_read(device):
    """Keys of whole blocks (64 keys for Triton's extend, pages for the reference) before
    the earliest query's window hold NaN: no set may load them."""
    spans = [(70, 6), (3, 4)]  # the first query of sequence 0 sees 66..70 (window 5)
    batch = make_paged_batch([76, 7], 16, 1, HEAD_DIM, F32, device, seed=17)
    for cache in (batch.k_cache, batch.v_cache):
        cache.flatten(0, 1)[[batch.slot(0, j) for j in range(64)]] = float("nan")
    q = randn((10, 2, HEAD_DIM), F32, device, seed=18)
    _extend_both_sets(q, batch, spans, device, 5, None)
    args = (q[:2], batch.k_cache, batch.v_cache, batch.page_table, index([76, 7], device))
    got = TRITON.decode_attention(*args, 2, window=5)
    want = ref.decode_attention(*args, window=5)
    for b, n in enumerate((76, 7)):
        dense = dense_attention(q[b : b + 1], batch, b, [n - 1], 5)
        assert_close_to_dense(want[b : b + 1], dense)
        assert_close_to_dense(got[b : b + 1], dense)
