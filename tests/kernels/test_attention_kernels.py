"""Triton extend and decode attention against the reference, on poisoned pools.

Every page size (1, 16, 64), GQA ratio (1, 3, 8) and dtype appears, each pair of them
together once (a Latin square: nine cases, not 27). Each case is a ragged batch with a
length-1 sequence and lengths that end mid-page.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import reference as ref
from tests.kernels.conftest import TRITON
from tests.kernels.paged import assert_close, index, make_paged_batch, randn

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
