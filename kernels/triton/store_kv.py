"""Write a step's new keys and values into their pool slots (Triton).

Layout as `radixserve.kernels.reference.store_kv`: caches (num_pages, page_size, H_kv, D),
k, v (T, H_kv, D), slot_mapping (T,) with -1 for padding. One program per token copies its
H_kv * D keys and values.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton.checks import (
    block,
    check_index,
    check_pages,
    check_same_dtype,
    check_tensor,
)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # a padding token (slot -1) copies no heads; written as a bound rather than a third
    # mask term because the interpreter mis-types (block & scalar) boolean masks
    heads = tl.where(slot >= 0, NUM_HEADS, 0)
    mask = (h < heads) & (d < HEAD_DIM)
    dst = slot * (NUM_HEADS * HEAD_DIM) + h * HEAD_DIM + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    tl.store(k_cache_ptr + dst, k, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(v_cache_ptr + dst, v, mask=mask)


def store_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """k, v (T, H_kv, D) into slots `slot_mapping` (T,) of k_cache, v_cache."""
    op = "store_kv"
    check_pages(op, "k_cache", k_cache)
    check_pages(op, "v_cache", v_cache)
    _, _, heads, dim = k_cache.shape
    tokens = slot_mapping.shape[0] if slot_mapping.dim() == 1 else -1
    check_index(op, "slot_mapping", slot_mapping, (None,))
    check_tensor(op, "k", k, (tokens, heads, dim))
    check_tensor(op, "v", v, (tokens, heads, dim))
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"{op}: v_cache {tuple(v_cache.shape)} != k_cache {tuple(k_cache.shape)}")
    check_same_dtype(op, k_cache=k_cache, v_cache=v_cache, k=k, v=v)
    if tokens == 0:
        return
    _store_kv_kernel[(tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=heads, HEAD_DIM=dim, BLOCK_H=block(heads), BLOCK_D=block(dim),
    )  # fmt: skip
