"""Triton store_kv, pack/unpack_pages, rmsnorm, rope and silu_and_mul against the
reference, over every dtype; the paged ones on pools poisoned with NaN, compared bit for
bit (NaN included) so that a stray write shows."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels import reference as ref
from radixserve.model.config import RopeScaling
from radixserve.model.rope import inverse_frequencies
from tests.kernels.conftest import TRITON
from tests.kernels.paged import DTYPES, assert_close, index, make_paged_batch, randn

DTYPE_IDS = [str(d).removeprefix("torch.") for d in DTYPES]


def _assert_same_bits(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size,kv_heads", [(1, 1), (16, 2), (64, 8)])
def test_store_kv_writes_only_its_slots(device, dtype, page_size, kv_heads):
    # token slots in two sequences' shuffled pages: one mid-page, one at a page's end,
    # padding (-1) between them
    batch = make_paged_batch([page_size + 2, 5], page_size, kv_heads, 16, dtype, device)
    positions = [(0, 0), (0, page_size + 1), (1, 4), (1, 0)]
    slots = [batch.slot(b, p) for b, p in positions]
    slots.insert(2, -1)
    k = randn((len(slots), kv_heads, 16), dtype, device, seed=1)
    v = randn((len(slots), kv_heads, 16), dtype, device, seed=2)
    caches = [batch.k_cache.clone(), batch.v_cache.clone()]
    TRITON.store_kv(batch.k_cache, batch.v_cache, index(slots, device), k, v)
    ref.store_kv(caches[0], caches[1], index(slots, device), k, v)
    _assert_same_bits(batch.k_cache, caches[0])
    _assert_same_bits(batch.v_cache, caches[1])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_pack_and_unpack_pages(device, dtype, page_size):
    layers, pages, heads, dim = 3, 9, 2, 16
    kv = torch.full((layers, 2, pages, page_size, heads, dim), float("nan"))
    listed = [7, 2, 5]
    kv[:, :, listed] = torch.randn(layers, 2, len(listed), page_size, heads, dim)
    kv = kv.to(dtype).to(device)
    ids = index(listed, device)
    packed = TRITON.pack_pages(kv, ids)
    assert not torch.isnan(packed).any()  # only listed pages were read
    _assert_same_bits(packed, ref.pack_pages(kv, ids))
    into = torch.empty_like(packed)
    assert TRITON.pack_pages(kv, ids, out=into) is into
    _assert_same_bits(into, packed)
    target, expected = kv.clone(), kv.clone()
    new = randn(tuple(packed.shape), dtype, device, seed=3)
    back = index([0, 8, 2], device)
    TRITON.unpack_pages(target, back, new)
    ref.unpack_pages(expected, back, new)
    _assert_same_bits(target, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rmsnorm_with_and_without_residual(device, dtype):
    x = randn((5, 96), dtype, device, seed=1)
    residual = randn((5, 96), dtype, device, seed=2)
    weight = randn((96,), dtype, device, seed=3)
    got, got_sum = TRITON.rmsnorm(x, weight, 1e-5, residual)
    want, want_sum = ref.rmsnorm(x, weight, 1e-5, residual)
    assert_close(got, want)
    assert_close(got_sum, want_sum)
    got, same = TRITON.rmsnorm(x, weight, 1e-5)
    assert same is x
    assert_close(got, ref.rmsnorm(x, weight, 1e-5)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rope_in_place_on_views_of_the_fused_qkv(device, dtype):
    tokens, heads, kv_heads, dim = 6, 6, 2, 16
    scaling = RopeScaling("llama3", 8.0, 1.0, 4.0, 32)
    inv_freq = inverse_frequencies(dim, 10000.0, scaling)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq[None, :]  # (64, D/2)
    cos, sin = angles.cos().to(device), angles.sin().to(device)
    positions = index([0, 1, 17, 63, 5, 5], device)
    qkv = randn((tokens, (heads + 2 * kv_heads) * dim), dtype, device, seed=4)
    expected = qkv.clone()
    for buf, rope in ((qkv, TRITON.rope), (expected, ref.rope)):
        q = buf[:, : heads * dim].view(tokens, heads, dim)
        k = buf[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
        rope(q, k, positions, cos, sin)
    assert_close(qkv, expected)
    v_cols = slice((heads + kv_heads) * dim, None)
    _assert_same_bits(qkv[:, v_cols], expected[:, v_cols])  # v untouched


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_silu_and_mul(device, dtype):
    x = randn((4, 2 * 1100), dtype, device, seed=5) * 4  # wider than one block
    assert_close(TRITON.silu_and_mul(x), ref.silu_and_mul(x))
